"""A checkpoint folder onto the models' modules: :mod:`.checkpoint` (weight files read tensor by
tensor, or a rank's slices), :mod:`.loader` (config, names mapped, weights placed, quantized linears
swapped in), :mod:`.gguf_blocks` (the GGUF's own 4-bit blocks) and :mod:`.sharding` (what a
tensor-parallel rank holds and the communication wrapped around its modules).

Imports the models room, never the execution room: what runs a loaded model is not its loader's
concern.
"""
