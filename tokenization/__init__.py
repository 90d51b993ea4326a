"""Shared tokenization: where model files come from and how a prompt becomes token ids (chat
templates). The edge, the producers and the worker use it; it imports nothing else of ours."""
