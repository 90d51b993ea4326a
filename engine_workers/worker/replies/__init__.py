"""The worker's replies: ordered, coalescing publishing (``sender``) under the size limit
(``split``), the reply topics it knows (``topics``) and the gate on them (``gate``), the engine's
outputs turned into chunks (``outputs``), final answers (``answers``) and failed sends (``failures``)."""
