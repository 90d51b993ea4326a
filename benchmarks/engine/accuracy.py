"""``lockgate bench accuracy``: how far each precision mode's outputs are from float32's.

A *mode* is a named set of :class:`EngineConfig` fields applied over the float32 reference
(:data:`MODES`). Every mode is measured against one float32 reference run, on three things:

* greedy agreement over chat prompts (``benchmarks/data/accuracy_prompts.json``, each one user
  message through the model's chat template). *Teacher-forced*: the mode is fed float32's greedy
  continuation and, at each position, its argmax is compared with float32's token (the headline
  "% of tokens": one early flip does not count against every later position). *Free-running*: the
  mode's own greedy continuation against float32's: mean common-prefix length, share identical.
* next-token logits relative L2 error ``||l_mode - l_fp32|| / ||l_fp32||`` at the teacher-forced
  positions (mean and max).
* perplexity of a public-domain text (``benchmarks/data/shakespeare.txt``, README there) in fixed
  windows of ``window`` tokens started every ``stride`` tokens; a window scores the targets no
  earlier window scored (with ``stride == window``, disjoint windows, each window's first token is
  context only), and the ratio to float32's.

The logits come from the engine itself: :class:`Engine` loads the model in the mode (its loader,
weight formats, kernels, KV cache) and this module drives its :class:`ModelRunner` step by step, as
the scheduler would, minus the scheduling (a test checks the float32 greedy tokens equal
``Engine.generate``'s). Chat prompts: one prefill step per batch of prompts, then one decode step
per token, so decode attention reads K/V back from the paged cache as in serving. Perplexity
windows: the first token as a one-token step, then the rest as one continuation chunk, so *every*
position attends over K/V read back from the paged cache (a start-of-sequence chunk would attend to
its fresh K/V: a KV-cache precision mode would show in no position).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_workers.engine.config import EngineConfig
from engine_workers.model.execution.batch import Chunk, ModelInput

DATA = Path(__file__).parent.parent / "data"
PROMPTS_FILE = DATA / "accuracy_prompts.json"
TEXT_FILE = DATA / "shakespeare.txt"


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    settings: dict[str, object]  # EngineConfig fields over the float32 reference
    weights: str | None  # the Engine.weight_format the mode must load (None: not checked)


# The reference every mode is compared with; a mode's settings override these.
REFERENCE: dict[str, object] = {"dtype": "float32", "quantization": "none"}
MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("fp32", {}, "float32"),  # the reference re-run: checks the measurement is deterministic
    Mode("bf16", {"dtype": "bfloat16"}, "bfloat16"),
    Mode("int8", {"quantization": "int8"}, "int8"),
    Mode("q4_1", {"quantization": "q4_1"}, "q4_1"),
    Mode("bf16-kv", {"kv_cache_dtype": "bfloat16"}, "float32"),
    Mode("w8a8", {"quantization": "w8a8"}, "w8a8"),
    Mode("w8a8-bf16kv", {"quantization": "w8a8", "kv_cache_dtype": "bfloat16"}, "w8a8"),  # the fastest mode
    Mode("auto", {"dtype": "auto"}, None),  # what the engine runs with no precision flags on this host
)}


class ModeUnavailable(ValueError):
    """A mode this build or this machine cannot run (unknown name, a field or value EngineConfig
    does not accept, kernels missing so the engine fell back to another weight format)."""


def mode_config(base: EngineConfig, name: str) -> EngineConfig:
    """``base`` in mode ``name``; :class:`ModeUnavailable` naming why where this build lacks it."""
    mode = MODES.get(name)
    if mode is None:
        raise ModeUnavailable(f"unknown accuracy mode {name!r}; known: {', '.join(MODES)}")
    settings = {**REFERENCE, **mode.settings}
    missing = [f for f in settings if f not in EngineConfig.__dataclass_fields__]
    if missing:
        raise ModeUnavailable(f"mode {name!r} needs EngineConfig.{missing[0]}, which this build does not have")
    try:
        return dataclasses.replace(base, **settings)  # type: ignore[arg-type]  # values checked by __post_init__
    except (TypeError, ValueError) as exc:
        raise ModeUnavailable(f"mode {name!r} ({mode.settings}) is not supported by this build: {exc}") from exc


def mode_problem(name: str) -> str | None:
    """Why this build cannot run mode ``name`` (None: it can, as far as its EngineConfig says)."""
    try:
        mode_config(EngineConfig(), name)
    except ModeUnavailable as exc:
        return str(exc)
    return None


def parse_modes(text: str) -> list[str]:
    """``"fp32,bf16"`` -> ``["fp32", "bf16"]``; raises :class:`ModeUnavailable` for a mode this
    build lacks and ValueError for an empty list."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ValueError("--modes names no mode")
    for name in names:
        if (why := mode_problem(name)) is not None:
            raise ModeUnavailable(why)
    return names


def load_prompts(n: int) -> list[str]:
    messages = json.loads(PROMPTS_FILE.read_text())
    if not 1 <= n <= len(messages):
        raise ValueError(f"--prompts must be 1..{len(messages)}, got {n}")
    return messages[:n]


# -- the drivers: the engine's ModelRunner stepped by hand ------------------------------------------


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _batches(lengths: Sequence[int], block_size: int, num_blocks: int) -> list[list[int]]:
    """Consecutive indices grouped so that each group's sequences (``lengths`` tokens at the end)
    fit in the KV cache together."""
    groups: list[list[int]] = []
    used = num_blocks
    for i, n in enumerate(lengths):
        need = _blocks(n, block_size)
        if need > num_blocks:
            raise ValueError(f"a sequence of {n} tokens needs {need} KV blocks; the cache has {num_blocks}")
        if used + need > num_blocks:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += need
    return groups


def decode(runner, prompts: Sequence[Sequence[int]], steps: int, forced: Sequence[Sequence[int]] | None = None,
           visit: Callable[[list[int], int, torch.Tensor], None] | None = None) -> list[list[int]]:
    """Greedy decoding of ``steps`` tokens per prompt: returns each position's argmax. With
    ``forced``, position ``t + 1`` is computed after ``forced[i][t]`` instead of the argmax
    (teacher forcing). ``visit(prompt_indices, t, logits [B, vocab])`` sees every step's logits."""
    bs = runner.block_size
    out: list[list[int]] = [[] for _ in prompts]
    for batch in _batches([len(p) + steps for p in prompts], bs, runner.num_blocks):
        tables, first = [], 0
        for i in batch:
            n = _blocks(len(prompts[i]) + steps, bs)
            tables.append(list(range(first, first + n)))
            first += n
        chunks = tuple(Chunk(list(prompts[i]), 0, table, True) for i, table in zip(batch, tables))
        for t in range(steps):
            logits = runner.execute(ModelInput(chunks)).logits
            if visit is not None:
                visit(batch, t, logits)
            picks = logits.argmax(-1).tolist()
            for i, tok in zip(batch, picks):
                out[i].append(tok)
            feed = picks if forced is None else [forced[i][t] for i in batch]
            chunks = tuple(Chunk([tok], len(prompts[i]) + t, table, True) for i, tok, table in zip(batch, feed, tables))
    return out


def text_nll(runner, ids: Sequence[int], window: int, stride: int) -> tuple[float, int]:
    """(summed negative log-likelihood, targets scored) of ``ids`` in windows (module doc)."""
    if not 2 <= window <= runner.num_blocks * runner.block_size:
        raise ValueError(f"--window must be 2..{runner.num_blocks * runner.block_size} (the KV cache), got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"--stride must be 1..window ({window}), got {stride}")
    table = list(range(_blocks(window, runner.block_size)))
    total, count, scored_to, begin = 0.0, 0, 0, 0
    while begin + 1 < len(ids):
        end = min(begin + window, len(ids))
        seg = list(ids[begin:end])
        # row k predicts seg[k + 1]; the continuation chunk reads seg[0]'s K/V back from the cache
        rows = [runner.execute(ModelInput((Chunk(seg[:1], 0, table, True),), every_row=True)).logits]
        if len(seg) > 2:
            rows.append(runner.execute(ModelInput((Chunk(seg[1:-1], 1, table, True),), every_row=True)).logits)
        skip = max(0, scored_to - (begin + 1))  # targets an earlier window scored
        targets = torch.tensor(seg[1 + skip:], device=rows[0].device)
        total += float(F.cross_entropy(torch.cat(rows)[skip:], targets, reduction="sum"))
        count += len(targets)
        scored_to = end
        if end == len(ids):
            break
        begin += stride
    return total, count


# -- per-mode measurement ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModeResult:
    mode: str
    settings: dict[str, object]
    weights: str  # the engine's weight format
    positions: int  # teacher-forced positions compared
    token_agreement: float  # teacher-forced: share of positions whose argmax is float32's token
    prefix_mean: float  # free-running: mean common-prefix length with float32's continuation
    identical: float  # free-running: share of prompts with the whole continuation identical
    rel_l2_mean: float  # next-token logits vs float32's, at the teacher-forced positions
    rel_l2_max: float
    perplexity: float
    perplexity_ratio: float  # / float32's
    seconds: float  # loading and measuring this mode


@dataclass(frozen=True, slots=True)
class Reference:
    prompts: list[list[int]]
    tokens: list[list[int]]  # float32's greedy continuations
    logits: torch.Tensor  # [prompts, steps, vocab] float32's next-token logits along them
    nll: float
    nll_count: int
    text_tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.nll_count)


@dataclass(frozen=True, slots=True)
class Report:
    model: str
    device: str
    prompts: int
    new_tokens: int
    text_tokens: int
    ppl_targets: int
    reference_perplexity: float  # float32's
    window: int
    stride: int
    reference_seconds: float
    results: list[ModeResult]
    machine: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _engine(config: EngineConfig, name: str):
    from engine_workers.engine.core import Engine

    engine = Engine(config)
    want = MODES[name].weights
    if want is not None and engine.weight_format != want:
        raise ModeUnavailable(f"mode {name!r} loaded {engine.weight_format} weights, not {want}: its kernels are "
                              "unavailable here (the log says why)")
    return engine


def reference(config: EngineConfig, messages: Sequence[str], steps: int, text: str, text_tokens: int | None,
              window: int, stride: int) -> Reference:
    engine = _engine(mode_config(config, "fp32"), "fp32")
    prompts = [engine.prompts.chat_ids([{"role": "user", "content": m}]) for m in messages]
    ids = engine.prompts.text_ids(text)
    ids = ids[:text_tokens] if text_tokens else ids
    logits = torch.empty(len(prompts), steps, engine.loaded.spec.vocab_size)

    def keep(batch: list[int], t: int, rows: torch.Tensor) -> None:
        logits[batch, t] = rows.cpu()

    tokens = decode(engine.runner, prompts, steps, visit=keep)
    nll, count = text_nll(engine.runner, ids, window, stride)
    return Reference(prompts, tokens, logits, nll, count, len(ids))


def measure_mode(config: EngineConfig, name: str, ref: Reference, text: str, window: int, stride: int) -> ModeResult:
    start = time.perf_counter()
    engine = _engine(mode_config(config, name), name)
    steps = ref.logits.shape[1]
    errors: list[torch.Tensor] = []

    def compare(batch: list[int], t: int, rows: torch.Tensor) -> None:
        want = ref.logits[batch, t].double()
        errors.append((rows.cpu().double() - want).norm(dim=-1) / want.norm(dim=-1))

    forced = decode(engine.runner, ref.prompts, steps, forced=ref.tokens, visit=compare)
    agree = sum(a == b for got, want in zip(forced, ref.tokens) for a, b in zip(got, want))
    free = decode(engine.runner, ref.prompts, steps)
    prefixes = [next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), steps) for got, want in zip(free, ref.tokens)]
    ids = engine.prompts.text_ids(text)[: ref.text_tokens]
    nll, count = text_nll(engine.runner, ids, window, stride)
    assert count == ref.nll_count  # the same windows, the same targets
    err = torch.cat(errors)
    ppl = math.exp(nll / count)
    weights = engine.weight_format
    del engine
    gc.collect()
    return ModeResult(name, dict(MODES[name].settings), weights, err.numel(), agree / err.numel(), sum(prefixes) / len(prefixes),
                      sum(p == steps for p in prefixes) / len(prefixes), float(err.mean()), float(err.max()), ppl,
                      ppl / ref.perplexity, time.perf_counter() - start)


def measure(config: EngineConfig, modes: Sequence[str], messages: Sequence[str], steps: int, text: str,
            text_tokens: int | None = None, window: int = 1024, stride: int = 1024,
            progress: Callable[[str], None] | None = None) -> Report:
    """Every mode in ``modes`` against one float32 reference of ``config`` (its precision fields
    are the modes'). Runs on the process's torch thread (engine_workers.engine.torch_thread)."""
    from engine_workers.engine import torch_thread

    for name in modes:
        mode_config(config, name)  # refuse an unavailable mode before the first model loads
    return torch_thread.call(_measure, config, list(modes), list(messages), steps, text, text_tokens, window, stride,
                             progress or (lambda _line: None))


def _measure(config, modes, messages, steps, text, text_tokens, window, stride, progress) -> Report:
    start = time.perf_counter()
    ref = reference(config, messages, steps, text, text_tokens, window, stride)
    ref_seconds = time.perf_counter() - start
    progress(f"reference (fp32): {ref_seconds:.1f} s, perplexity {ref.perplexity:.4f} over {ref.nll_count} targets")
    results = []
    for name in modes:
        results.append(measure_mode(config, name, ref, text, window, stride))
        progress(format_row(results[-1]))
    model = str(config.model or "default")
    return Report(model, config.resolved_device(), len(ref.prompts), steps, ref.text_tokens, ref.nll_count, ref.perplexity,
                  window, stride, ref_seconds, results)


HEADER = (f"{'mode':<13}{'weights':<10}{'agree':>8}{'prefix':>8}{'ident':>7}{'relL2 mean':>12}{'relL2 max':>11}"
          f"{'ppl':>10}{'ppl/fp32':>10}{'s':>7}")


def format_row(r: ModeResult) -> str:
    return (f"{r.mode:<13}{r.weights:<10}{r.token_agreement:>8.2%}{r.prefix_mean:>8.1f}{r.identical:>7.0%}"
            f"{r.rel_l2_mean:>12.4f}{r.rel_l2_max:>11.4f}{r.perplexity:>10.4f}{r.perplexity_ratio:>10.4f}{r.seconds:>7.0f}")


def format_table(report: Report) -> str:
    return "\n".join([HEADER, *map(format_row, report.results)])


def run(args) -> int:
    import sys

    from benchmarks.engine.bench import machine_info
    from lockgate.options import engine_config_from_args

    if args.dtype not in ("auto", "float32", "fp32") or args.quantization != "none":
        raise ValueError("lockgate bench accuracy sets --dtype and --quantization per mode: use --modes")
    config = dataclasses.replace(engine_config_from_args(args), enable_prefix_caching=False)  # the runner is driven directly
    machine = machine_info()  # before loading: the load average is the other users'
    text = TEXT_FILE.read_text()
    print(f"lockgate bench accuracy --modes {','.join(args.modes)}: {args.prompts} chat prompts x {args.new_tokens} tokens; "
          f"perplexity of {TEXT_FILE.name} ({args.text_tokens or 'all'} tokens) in windows of {args.window}, stride {args.stride}",
          flush=True)
    report = measure(config, args.modes, load_prompts(args.prompts), args.new_tokens, text, args.text_tokens or None,
                     args.window, args.stride, progress=lambda line: print(line, file=sys.stderr, flush=True))
    report = dataclasses.replace(report, machine=machine)
    m = machine
    print(f"machine: {m['cpu_model']}, {m['usable_cores']} of {m['cpu_count']} cores; torch {m['torch']}; load average at "
          f"start {'/'.join(f'{v:.2f}' for v in m['loadavg_1_5_15_at_start'] or [])}")
    print(f"model {report.model} on {report.device}; {report.prompts * report.new_tokens} teacher-forced positions; "
          f"{report.ppl_targets} perplexity targets of {report.text_tokens} tokens; float32 reference: perplexity "
          f"{report.reference_perplexity:.4f}, {report.reference_seconds:.0f} s")
    print(format_table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0
