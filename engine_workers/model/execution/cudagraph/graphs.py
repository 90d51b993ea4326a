"""Captured CUDA graphs of the decode forward, one per ``(batch, width)`` bucket, replayed with
static input buffers; every other step runs eager (:mod:`engine_workers.model.execution.cudagraph.buckets`
says which and how inputs are padded).

A small model's decode step on a GPU is launch-bound: the host issues some twenty kernels per
layer while the device waits (docs/gpu.md). A graph replays the whole forward's kernels in one
launch. What it needs:

* **Static inputs.** Each graph owns one int64 device buffer holding, per row, the token id, its
  position, its K/V slot and its context length, then the ``batch x width`` block table; a step
  writes its padded values into a pinned host copy and issues one host-to-device copy before the
  replay. The decode mask is computed inside the graph from the context lengths.
* **Only capturable models.** No host reads of device values inside the forward, no branch on the
  step's data: MoE (its expert counts go to the host), sliding windows, soft-capping and sinks
  (branch on the longest context), longrope / dynamic RoPE (per-step rotations), MLA and tensor
  parallelism run eager (:func:`graph_problem`).
* **A dummy block.** The runner allocates one KV block past the KV manager's pool; padded rows
  write and read only there.

Capture happens once at start (:meth:`DecodeGraphs.capture_all`), largest graph first so the
shared memory pool is sized by it: per graph one eager warm-up on all-padding inputs (which
touch only the dummy block), then the capture. Contexts wider than vLLM's default
``max_seq_len_to_capture`` (8192 tokens) run eager, which bounds the width buckets.

**Untested on a GPU so far** (no device was lent while it was written): the CUDA-marked test
``tests/engine_workers/model/test_cudagraph_gpu.py`` (graph vs eager, exact) and
``scripts/device_check.sh`` are ready for the first session that has one. What runs on a CPU: the
padding and the metadata built from the static buffers (:func:`static_metadata`), against the
eager path (tests/engine_workers/model/test_cudagraph_padding.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine_workers.model.execution.cudagraph.buckets import Chunk, Padded, batch_buckets, pad, plan, width_buckets
from engine_workers.model.models.attention import AttnMetadata, DecodeGroup

log = logging.getLogger(__name__)

MAX_SEQ_LEN_TO_CAPTURE = 8192  # vLLM's default: longer contexts decode eager


def graph_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s decode forward cannot be captured (module docstring), or None."""
    from engine_workers.model.loading.sharding.layers import GatheredHead
    from engine_workers.model.models.llama import LlamaForPagedLM

    if not isinstance(model, LlamaForPagedLM):
        return f"{type(model).__name__} is not the paged decoder"
    spec = model.spec
    checks = [(spec.moe is not None, "MoE routing reads expert counts on the host"),
              (spec.mla is not None, "multi-head latent attention"),
              (spec.windowed, "sliding-window layers branch on the step's longest context"),
              (spec.attn_softcap is not None or spec.attn_sinks, "soft-capped or sink attention takes the masked path"),
              (model.needs_seq_ends, "longrope / dynamic RoPE rotates by each step's contexts"),
              (isinstance(model.lm_head, GatheredHead), "tensor parallelism")]
    return next((why for bad, why in checks if bad), None)


class Static:
    """One graph's input buffers: ``packed`` (device) and its views, and a pinned host twin."""

    def __init__(self, batch: int, width: int, device: torch.device) -> None:
        self.batch, self.width = batch, width
        n = 4 * batch + batch * width
        self.packed = torch.zeros(n, dtype=torch.long, device=device)
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=device.type == "cuda")
        b = batch
        self.ids, self.positions, self.slots, self.ctx = (self.packed[i * b:(i + 1) * b] for i in range(4))
        self.tables = self.packed[4 * b:].view(b, width)
        self.rows = torch.arange(b, device=device)

    def load(self, p: Padded, copied: torch.cuda.Event | None = None) -> None:
        """Stage ``p`` and copy it to the device buffer (asynchronously on CUDA: ``copied`` is
        recorded after the copy, and waited on before the host twin is written again)."""
        if (p.batch, p.width) != (self.batch, self.width):
            raise ValueError(f"inputs of shape {(p.batch, p.width)} for a graph of {(self.batch, self.width)}")
        if copied is not None:
            copied.synchronize()  # the previous step's copy has left the host buffer
        self.host.copy_(torch.tensor(p.ids + p.positions + p.slots + p.ctx + p.tables, dtype=torch.long))
        self.packed.copy_(self.host, non_blocking=copied is not None)
        if copied is not None:
            copied.record()


def static_metadata(s: Static, block_size: int, dtype: torch.dtype) -> AttnMetadata:
    """The decode step's attention metadata from ``s``'s buffers, built with device ops only (so it
    can be captured): one decode group of every row, its additive mask from the context lengths."""
    j = torch.arange(s.width * block_size, device=s.packed.device)
    mask = torch.zeros((s.batch, s.width * block_size), dtype=dtype, device=s.packed.device)
    mask.masked_fill_(j[None, :] >= s.ctx[:, None], float("-inf"))
    group = DecodeGroup(s.rows, s.tables, mask[:, None, None, :], s.ctx)
    return AttnMetadata(s.slots, block_size, (group,), (), max_context=s.width * block_size)


class DecodeGraphs:
    """The graphs of one runner's model and KV cache (``dummy_block``: the block padded rows use)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 dummy_block: int, dtype: torch.dtype, device: torch.device, max_num_seqs: int, max_model_len: int,
                 sdpa_backends: Sequence[SDPBackend] | None = None) -> None:
        self.model, self.kv_caches, self.block_size, self.dummy = model, kv_caches, block_size, dummy_block
        self.dtype, self.device, self.sdpa_backends = dtype, device, sdpa_backends
        self.batches = batch_buckets(max_num_seqs)
        self.widths = width_buckets(-(-min(max_model_len, MAX_SEQ_LEN_TO_CAPTURE) // block_size))
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Static, torch.Tensor]] = {}
        self.counts: Counter[str] = Counter()  # "replay", and per eager reason
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def _sdpa(self):
        return sdpa_kernel(list(self.sdpa_backends)) if self.sdpa_backends else contextlib.nullcontext()

    def forward(self, s: Static) -> torch.Tensor:
        """The decode forward over ``s``'s buffers: logits ``[batch, vocab]`` float32."""
        with self._sdpa():
            return self.model(s.ids, s.positions, self.kv_caches, static_metadata(s, self.block_size, self.dtype), s.rows)

    @torch.inference_mode()
    def capture_all(self) -> None:
        keys = sorted(((b, w) for b in self.batches for w in self.widths), key=lambda k: k[0] * k[1], reverse=True)
        pool = torch.cuda.graph_pool_handle()
        for key in keys:
            s = Static(*key, self.device)
            s.load(pad([], key, self.block_size, self.dummy))  # all padding: only the dummy block is touched
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward(s)  # warm-up: lazy library init and allocations happen outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(s)
            self.graphs[key] = (graph, s, out)
        torch.cuda.synchronize()
        log.info("CUDA graphs: %d captured (batch %s x table width %s blocks)", len(self.graphs),
                 ",".join(map(str, self.batches)), ",".join(map(str, self.widths)))

    def run(self, chunks: Sequence[Chunk], every_row: bool = False, wants_hidden: bool = False,
            pools: bool = False) -> torch.Tensor | None:
        """The step's logits from a graph replay, or None: the caller runs it eager."""
        verdict = plan(chunks, self.block_size, self.batches, self.widths, every_row, wants_hidden, pools)
        got = self.graphs.get(verdict.key) if verdict.key is not None else None
        if got is None:
            self.counts[verdict.reason or "not captured"] += 1
            return None
        graph, s, out = got
        p = pad(chunks, (s.batch, s.width), self.block_size, self.dummy)
        s.load(p, self._copied)
        graph.replay()
        self.counts["replay"] += 1
        return out[: p.real].clone()  # the buffer is overwritten by the next replay
