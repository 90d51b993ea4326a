"""The seeded workload of ``lockgate bench engine`` (the vLLM / llama.cpp anchors' workload,
shared/anchors/README.md "Workload") and the KV arithmetic over it: how many of its sequences a KV
budget holds at once, paged vs reserved contiguously."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

# The anchors' workload (shared/anchors/README.md): 32 requests, seed 0, SmolLM2's 49152-token vocabulary.
ANCHOR_WORKLOAD_SHA256_16 = "aab3167ce97ad994"


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def fingerprint(self) -> str:
        """The anchors' ``workload_sha256_16``: equal fingerprints, equal requests."""
        return hashlib.sha256(json.dumps([self.prompts, self.outputs], separators=(",", ":")).encode()).hexdigest()[:16]


def make_workload(vocab: int, n: int, seed: int, prompt_range=(8, 256), output_range=(8, 96), low: int = 3) -> Workload:
    # The draw order is the anchors': each prompt's length then its ids, then all output lengths.
    rng = random.Random(seed)
    prompts = [[rng.randrange(low, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return Workload(prompts, outputs)


def capacity(wl: Workload, num_blocks: int, block_size: int, max_model_len: int) -> dict:
    """Sequences of the workload's mix resident at once in a KV budget of ``num_blocks`` blocks:
    paged (each holds ceil(tokens / block_size) blocks) vs contiguous, where each reserves its
    prompt + max_tokens up front (what an engine without paging reserves; with EOS ignored every
    sequence fills its reservation, so paging gains nothing here but loses its last block's slack:
    its gain is requests that stop early). ``contiguous_sequences_at_max_model_len`` is the
    reservation of an engine that sizes every slot for the longest context, for reference."""
    lens = [len(p) + m for p, m in zip(wl.prompts, wl.outputs)]
    blocks = sum(-(-n // block_size) for n in lens)
    tokens = num_blocks * block_size
    paged, contiguous = num_blocks * len(lens) // blocks, tokens * len(lens) // sum(lens)
    return {"kv_blocks": num_blocks, "block_size": block_size, "kv_tokens": tokens,
            "mean_sequence_tokens": sum(lens) / len(lens), "mean_sequence_blocks": blocks / len(lens),
            "paged_sequences": paged, "contiguous_sequences": contiguous,
            "ratio": paged / contiguous if contiguous else float("inf"),
            "max_model_len": max_model_len, "contiguous_sequences_at_max_model_len": tokens // max_model_len}
