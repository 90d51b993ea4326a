"""What the worker holds and commits: the ledger of held records (``ledger``), the per-partition
low-watermark commits (``watermark``), and dead letters committed once acknowledged
(``dead_letters``)."""
