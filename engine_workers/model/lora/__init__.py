"""LoRA adapters on the paged decoder (issue 53): PEFT-format adapters loaded onto lockgate's fused
layers (:mod:`.adapter`), the batched low-rank update per adapter segment (:mod:`.layers`), and the
engine's registry of named adapters with its host LRU and per-batch slots (:mod:`.manager`).
docs/lora.md says what is supported and what is refused."""
