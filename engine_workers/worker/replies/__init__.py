"""The worker's replies: ordered, coalescing publishing (``sender``) under the size limit
(``split``), the reply topics it knows (``topics``), the engine's outputs turned into chunks
(``outputs``) and final answers (``answers``)."""
