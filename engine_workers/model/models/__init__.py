"""The decoder every family runs on and what it is built from: :mod:`.spec` (a checkpoint's config
parsed and refused field by field), :mod:`.llama` (the decoder), the family parts it switches on
(:mod:`.moe` and :mod:`.moe_family`, :mod:`.mla`), the layers its forward calls (:mod:`.attention`,
:mod:`.rope`) and :mod:`.split` (the tensor-parallel tag a family's name mapping puts on a tensor).

Imports nothing of the loading or the execution rooms: a module here is built from a spec and run
on a batch's attention metadata, whoever loaded it and whoever runs it.
"""
