"""The offline engine: ``add_request`` / ``step`` / ``abort``.

One ``step()`` = schedule -> execute -> postprocess: the scheduler decides a batch, the engine
turns it into a typed :class:`~engine_workers.model.execution.batch.ModelInput` (tokens, positions' start,
block tables), the runner executes it in one forward and returns a ``RunnerOutput`` (logits, and
for embedding requests final-norm states), then the pooler ends embedding requests with their
vector, the sampler draws one token for every other sequence whose known tokens are all computed,
and finished sequences release their blocks at once. The engine is synchronous and single-threaded; ``AsyncEngine`` runs it
on a thread of its own for the actors. Loading and ``step()`` hop onto the process's torch thread
(:mod:`engine_workers.engine.torch_thread`), whichever thread calls them: torch's OpenMP pools slow every
forward down once two threads have run torch work.

Speculative decoding (``--speculative-config``; n-gram prompt lookup, :mod:`engine.ngram`, or a
draft model, :mod:`engine.draft`): before each schedule, every decoding request that may
speculate (see :meth:`Engine._propose`) gets up to k proposed tokens. The scheduler runs them as extra positions of its decode chunk, the runner returns logits
for every position of that chunk, each attending exactly as a single-token decode of its position
would (``ModelInput.verify``), and the sampler draws every position with the draw plain decoding
would use there (output position = tokens before it, the sequence's seed) and the penalties and
``min_tokens`` state of the tokens before it. The longest prefix of proposals equal to those draws
is accepted, then the draw at the first disagreement (or after the last proposal); each token goes
through the stop checks one by one, so a request ends exactly where plain decoding ends it. Since
each draw depends only on (seed, position) and logits identical bit for bit to plain decoding's,
the accepted tokens are the plain-decoding tokens (docs/design-history.md, Speculative decoding). The K/V
of rejected positions are rolled back: the computed count stops at the accepted tokens and the
blocks past them are given back (never registered in the prefix cache: only blocks full of
computed tokens are).

Resume is bit-exact for the same reason: a request resumed with ``resume_token_ids`` (or
readmitted after a preemption) prefills its prompt and then recomputes its output tokens as
replay chunks (``ModelInput.replay``), every row attending as the decode of its position did in
the uninterrupted run (engine.scheduler, "output tokens are always computed as decode rows").
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import Future

import torch

from engine_workers.engine import torch_thread
from engine_workers.engine.config import EngineConfig
from engine_workers.engine.detokenizer import IncrementalDetokenizer
from engine_workers.engine.draft import DraftItem, DraftProposer, check_tokenizers
from engine_workers.engine.guided import GrammarCache, Guide, GuidedSpec, LazyGrammars, MaskBuffer
from engine_workers.engine.mtp import MtpProposer
from engine_workers.engine.ngram import NgramProposer
from engine_workers.engine.outputs import CompletedRequest, EngineStats, RequestOutput
from engine_workers.engine.pooler import Pooler
from engine_workers.engine.sampler import Row, Sampler, SampleRow, TokenLogprobs
from engine_workers.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from engine_workers.engine.sequence import SeqStatus, SeqTimes, Sequence
from engine_workers.engine.speculative import SpecBackoff, batch_limit
from engine_workers.engine.step_model import StepModel
from engine_workers.kernels import cpu_malloc
from engine_workers.kernels.cpu_linear import auto_cpu_dtype, auto_kv_cache_dtype, cpu_weight_plan
from engine_workers.model.execution.batch import Chunk, ModelInput, RunnerOutput
from engine_workers.model.execution.parallel.group import TpGroup
from engine_workers.model.execution.parallel.runner import ParallelRunner, load_group
from engine_workers.model.execution.runner import ModelRunner, kv_budget_blocks, resolve_dtype, resolve_kv_dtype
from engine_workers.model.execution.smoothing import load_smoothed_w8a8
from engine_workers.model.loading.loader import LoadedModel, load_model, load_mtp
from engine_workers.model.lora.manager import LoraManager
from kv_store import KVCacheManager
from lockgate_types import FinishReason, SamplingParams
from tokenization.prompts import PromptTokenizer

log = logging.getLogger(__name__)

# Where decode rows attend over a gathered copy of their keys (SDPA, e.g. CUDA), a replay step
# (a resumed request's output tokens) gathers at most this many keys (rows x context): 2^20 keys
# gather 0.75 GiB of K (and as much of V) for SmolLM2-135M in float32, 2 GiB for an 8B model in bf16.
MAX_REPLAY_KEYS = 1 << 20


class _Req:
    __slots__ = ("seq", "detok", "pending_logprobs", "guide", "backoff")

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer, guide: Guide | None = None) -> None:
        self.seq = seq
        self.detok = detok
        self.pending_logprobs: list[TokenLogprobs] = []
        self.guide = guide  # the structured-output matcher of a guided_* request
        self.backoff = SpecBackoff()  # when this request may speculate (low-acceptance rule)


class Engine:
    """Not thread-safe: one thread calls every method (``AsyncEngine`` ensures this)."""

    def __init__(self, config: EngineConfig | None = None, tp_group: TpGroup | None = None) -> None:
        """``tp_group``: a tensor-parallel group already started, of ``config.tensor_parallel_size``
        ranks, to load into instead of starting one (its ranks load the new model; the caller closes
        it, not :meth:`close`). Tests use it to spare a process start per model."""
        self._own_group = tp_group is None
        torch_thread.call(self._init, config or EngineConfig(), tp_group)

    def _init(self, config: EngineConfig, tp_group: TpGroup | None = None) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cpu":
            cpu_malloc.tune()
        # On a CPU, bf16 / int8 are weight formats of the linear layers; everything else runs in
        # float32 (engine_workers/kernels/cpu_linear.py, cpu_weight_plan). weight_format says which.
        dtype = resolve_dtype(config.dtype, self.device)
        if config.dtype == "auto" and self.device.type == "cpu":  # per host: the fastest accurate mode
            dtype, why = auto_cpu_dtype(config.quantization, config.cpu_kernels)
            log.info("--dtype auto on this CPU: %s (%s)", str(dtype).removeprefix("torch."), why)
        self.dtype, lowp = cpu_weight_plan(dtype, config.quantization, self.device, config.cpu_kernels)
        self.weight_format = lowp or str(self.dtype).removeprefix("torch.")
        # K/V storage (auto = the compute dtype); checked before the model loads, so a refused
        # combination costs nothing
        kv_name, kv_why = auto_kv_cache_dtype(config.kv_cache_dtype, lowp) if self.device.type == "cpu" \
            else (config.kv_cache_dtype, None)
        if kv_why is not None:
            log.info("--kv-cache-dtype auto on this CPU: %s (%s)", kv_name, kv_why)
        self.kv_dtype = resolve_kv_dtype(kv_name, self.dtype, self.device)
        tp = config.tensor_parallel_size
        self.tp_group: TpGroup | None = None
        if tp > 1:
            loaded = self._load_parallel(config, lowp, tp_group)
        elif lowp == "w8a8":  # calibrated activation smoothing before quantizing (model/smoothing.py)
            loaded = load_smoothed_w8a8(config.model, self.device, config.block_size, config.max_model_len,
                                        config.cpu_kernels)
        else:
            loaded = load_model(config.model, self.dtype, self.device, config.max_model_len, config.weight_prepack,
                                config.cpu_kernels, lowp)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.prompts = PromptTokenizer(loaded.tokenizer, loaded.spec.max_position_embeddings)
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        # the budget is per rank: under tensor parallelism a block holds only the rank's KV heads
        # (model.spec is rank 0's local spec, the largest share of an uneven head split)
        num_blocks = kv_budget_blocks(loaded.model.spec, config.block_size, self.kv_dtype, self.device,
                                      config.kv_cache_bytes, config.kv_cache_memory_fraction)
        self.max_model_len = min(config.max_model_len or loaded.spec.max_position_embeddings,
                                 loaded.spec.max_position_embeddings, num_blocks * config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.step_model = StepModel()  # step time against batched tokens: the TPOT-sized step
        self.runner: ModelRunner | ParallelRunner
        if self.tp_group is not None:
            try:
                self.runner = ParallelRunner(self.tp_group, loaded, num_blocks, config.block_size, self.device,
                                             self.dtype, config.cpu_kernels, self.kv_dtype)
            except BaseException:
                if self._own_group:
                    self.tp_group.close()
                raise
        else:
            # LoRA segments change every step: no CUDA graphs with adapters (docs/lora.md)
            eager = config.enforce_eager or config.enable_lora
            graphs = None if eager else (config.max_num_seqs, self.max_model_len)
            self.runner = ModelRunner(loaded, num_blocks, config.block_size, self.device, self.dtype,
                                      config.cpu_kernels, self.kv_dtype, cuda_graphs=graphs)
            if config.enable_lora:
                self.runner.lora = self.lora = lora_manager(config, loaded, self.dtype, self.device)
        local = self.runner.local if isinstance(self.runner, ParallelRunner) else self.runner
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, max(config.max_num_batched_tokens, config.max_num_seqs),
                            config.long_prefill_token_threshold, config.priority_preemption_margin,
                            config.max_loras if config.enable_lora else None,
                            # decode rows on gather + SDPA: bound what a replay gathers per step
                            None if local.decode_kernel is not None else MAX_REPLAY_KEYS),
            self.kv,
        )
        self.sampler = Sampler(self.device, sorted(self.eos_token_ids))
        self.pooler = Pooler()
        # Seeds for requests without one: every request's draws are counter-based on a seed (see
        # engine.sampler), so an unseeded request is reproducible too once its seed is known.
        self._seeds = random.Random(config.seed)
        self._reqs: dict[str, _Req] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        # Structured output (engine.guided): the grammar cache is built on first use; the mask
        # stage runs only while some live request is guided.
        self._grammars = LazyGrammars(loaded.tokenizer, loaded.spec.vocab_size, sorted(self.eos_token_ids))
        self._masks = MaskBuffer(loaded.spec.vocab_size)
        self._num_guided = 0
        # adapters unloaded at run time: ``_retiring`` still used by requests (removed once they
        # finish, new requests refused), ``_unloaded`` never loaded again from a request's
        # ``lora_path`` (only by ``add_lora``): an unload is final until an explicit load
        self._retiring: set[str] = set()
        self._unloaded: set[str] = set()
        self.stats = EngineStats()
        self.speculative = spec = config.speculative_config
        self._proposer = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                          if spec is not None and spec.method == "ngram" else None)
        # a proposer with a model of its own: a draft model, or the checkpoint's MTP module
        self.draft: DraftProposer | MtpProposer | None = None
        if spec is not None and spec.method == "draft_model":
            self.draft = self._load_draft(config, spec.model, lowp)
        elif spec is not None and spec.method in ("mtp", "deepseek_mtp"):
            self.draft = MtpProposer(load_mtp(loaded, self.dtype, self.device), loaded.spec.vocab_size,
                                     config.block_size, self.device, self.dtype, self.kv_dtype, config.kv_cache_bytes,
                                     config.kv_cache_memory_fraction, self.sampler)
        self._extra = (loaded.spec.model_type + ":" + str(loaded.path)).encode()
        log.info("engine ready: %s on %s/%s (weights %s), max_model_len=%d, KV %d blocks (%d tokens, %s)",
                 loaded.path, self.device, self.dtype, self.weight_format, self.max_model_len, num_blocks,
                 num_blocks * config.block_size, str(self.kv_dtype).removeprefix("torch."))

    lora: LoraManager | None = None  # with enable_lora: the named adapters (engine_workers.model.lora)

    def _load_draft(self, config: EngineConfig, model: str | None, lowp: str | None) -> DraftProposer:
        """The draft model of ``--speculative-config``, in the target's weight format (float32 for
        w8a8, whose calibration is per model), refused unless it shares the target's tokenizer."""
        draft = load_model(model, self.dtype, self.device, None, config.weight_prepack, config.cpu_kernels,
                           None if lowp == "w8a8" else lowp)
        check_tokenizers(self.loaded, draft)
        return DraftProposer(draft, self.loaded.spec.vocab_size, config.block_size, self.device, self.dtype,
                             self.kv_dtype, config.cpu_kernels, config.kv_cache_bytes,
                             config.kv_cache_memory_fraction, self.sampler)

    def _load_parallel(self, config: EngineConfig, lowp: str | None, given: TpGroup | None) -> LoadedModel:
        """Start the tensor-parallel group (``self.tp_group``) and load every rank's shard."""
        tp = config.tensor_parallel_size
        if self.device.type == "cuda":
            have = torch.cuda.device_count()
            if have < tp:
                raise ValueError(f"--tensor-parallel-size {tp} on CUDA needs {tp} devices; torch sees {have}")
            raise ValueError(f"--tensor-parallel-size {tp} on CUDA (NCCL) is not implemented yet; tensor "
                             "parallelism runs on CPU (gloo): --device cpu")
        if not config.num_threads:  # one torch thread per rank: the ranks share the host's cores
            torch.set_num_threads(1)
        if given is not None and given.world != tp:
            raise ValueError(f"tp_group has {given.world} ranks, tensor_parallel_size is {tp}")
        group = self.tp_group = given or TpGroup(tp)
        try:
            return load_group(group, dict(spec=config.model, dtype=self.dtype, device=self.device,
                                                  max_len=config.max_model_len, weight_prepack=config.weight_prepack,
                                                  cpu_kernels=config.cpu_kernels, lowp=lowp))
        except BaseException:
            if self._own_group:
                group.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do without a group). The engine is unusable after."""
        if self.tp_group is not None and self._own_group:
            self.tp_group.close()

    # -- input ------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Seq[int] | None = None, messages: Iterable | None = None) -> list[int]:
        """Token ids for a request: chat messages through the template, text through the
        tokenizer (both via :class:`PromptTokenizer`, exactly as the edge does), ids as given."""
        if messages is not None:
            msgs = list(messages)
            if not msgs:
                raise ValueError("messages must not be empty")
            return self.prompts.chat_ids(msgs)
        if prompt is None:
            raise ValueError("prompt is required (text or token ids)")
        if isinstance(prompt, str):
            return self.prompts.text_ids(prompt)
        return list(prompt)

    def grammars(self) -> GrammarCache:
        """The compile cache of guided_* constraints for this engine's tokenizer (thread-safe)."""
        return self._grammars.get()

    def compile_async(self, spec: GuidedSpec) -> Future:
        """The compiled grammar of ``spec`` as a future; compiles off the calling thread
        (:class:`AsyncEngine` calls it before queueing a guided request)."""
        return self._grammars.compile_async(spec)

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: Iterable | None = None,
        priority: float = 0.0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        resume_token_ids: Seq[int] = (),
        lora: str | None = None,
        lora_path: str | None = None,
        tpot_slo_s: float | None = None,
        tier: int | None = None,
    ) -> None:
        """Queue a request. Raises ``ValueError`` naming the field for bad input; the engine's
        other requests are unaffected.

        ``resume_token_ids``: output tokens the request already produced (elsewhere, e.g. on a
        worker that crashed). They become the start of its output, not of its prompt: generation
        continues at output position ``len(resume_token_ids)`` with the same draws, penalties,
        ``min_tokens``/``max_tokens`` counts and text as the uninterrupted run, whose tokens from
        that position on it reproduces (same ``seed``). Outputs number tokens from that position
        (``seq``) and their text continues where the first run's released text stopped
        (``text_offset``).

        ``lora``: the name of a LoRA adapter the engine serves (``lora_modules``) to run the
        request with; None = the base model. Part of the request's prefix-cache key. ``lora_path``:
        where that adapter was loaded from at run time; an engine that lacks it loads it from there
        first (a ``ValueError`` naming what is wrong if that fails), unless it was unloaded here.

        ``tpot_slo_s``: its time-per-output-token target (its tier's SLO, from the worker): while
        it decodes, no step batches more tokens than fit in it (``EngineConfig.tpot_budget``).
        ``tier``: its tier, on which priority preemption decides (None: on ``priority``)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._reqs:
            raise ValueError(f"request_id {request_id!r} is already running")
        extra = self._extra + (b"|" + cache_salt.encode() if cache_salt else b"")
        if lora is not None:
            if self.lora is None:
                raise ValueError(f"lora={lora!r}: this engine serves no LoRA adapters (--enable-lora)")
            if lora in self._retiring:
                raise ValueError(f"LoRA adapter {lora!r} is being unloaded")
            if lora_path is not None and lora not in self.lora.paths:
                if lora in self._unloaded:
                    raise ValueError(f"LoRA adapter {lora!r} was unloaded")
                self.lora.add(lora, lora_path)  # loaded on first use (docs/lora.md, "At run time")
            self.lora.check(lora)
            extra += self.lora.identity(lora)
        ids = self.encode_prompt(prompt, messages)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.loaded.spec.vocab_size
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context limit is {self.max_model_len} "
                             f"(prompt must leave room for at least 1 new token)")
        bad_bias = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias token id {bad_bias} is outside the vocabulary [0, {vocab})")
        resumed = list(resume_token_ids)
        bad = next((t for t in resumed if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"resume_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab})")
        if resumed and (len(resumed) >= params.max_tokens or len(ids) + len(resumed) >= self.max_model_len):
            raise ValueError(f"resume_token_ids has {len(resumed)} tokens: the request already reached "
                             f"max_tokens={params.max_tokens} or the context limit {self.max_model_len}")
        seq = Sequence(
            seq_id=request_id,
            prompt_token_ids=ids,
            params=params,
            priority=float(priority),
            cache_extra=extra,
            lora=lora,
            times=SeqTimes(arrival_time if arrival_time is not None else time.monotonic()),
            tpot_slo_s=tpot_slo_s if tpot_slo_s is not None and tpot_slo_s > 0 else None,
            tier=tier,
        )
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        for t in resumed:
            if t in params.stop_token_ids or (not params.ignore_eos and t in self.eos_token_ids) or detok.add(t):
                raise ValueError("resume_token_ids already ends the request (EOS, stop token or stop string)")
        guide = None
        if params.guided is not None:  # compiled already (cache hit) when AsyncEngine submitted it
            guide = Guide(self.grammars().compile(params.guided))
            for t in resumed:  # a resumed request's matcher first walks the tokens it already produced
                if not guide.accept(t) or guide.terminated:
                    raise ValueError("resume_token_ids do not follow the request's guided_* constraint")
        seq.seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        if resumed:
            seq.output_token_ids.extend(resumed)
            detok.release(final=False)  # the first run released exactly this much of their text
        self._reqs[request_id] = _Req(seq, detok, guide)
        self._num_guided += guide is not None
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; its blocks are free when this returns. The final
        output (``finish_reason="abort"``) comes with the next ``step()``."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req.seq)
        self._finish(req, FinishReason.ABORT, time.monotonic(), self._pending)
        return True

    # -- the loop ---------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._reqs) or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """One iteration (see the module doc); runs on the torch thread, the caller waits."""
        return torch_thread.call(self._step)

    def _step(self) -> list[RequestOutput]:
        """schedule -> ``runner.execute(ModelInput)`` -> postprocess (pool, sample, finish)."""
        started = time.monotonic()
        outputs, self._pending = self._pending, []
        if self.speculative is not None:
            self._propose()
        sched = self.scheduler.schedule(self._token_budget())
        self.stats.preemptions = self.scheduler.num_preemptions
        if self._retiring:
            self._retire_loras()
        if sched.is_empty:
            return outputs
        batch = self._model_input(sched)
        result = self.runner.execute(batch)
        self.scheduler.on_step_done(sched)
        self.stats.steps += 1
        self.stats.last_batch_tokens = sched.num_batched_tokens
        self.stats.last_batch_seqs = len(sched.scheduled)
        self.stats.computed_tokens += sched.num_batched_tokens
        self._postprocess(sched, batch, result, outputs)
        if result.states is not None and isinstance(self.draft, MtpProposer):  # the rows the MTP module reads
            first = 0
            for item, chunk in zip(sched.scheduled, batch.chunks, strict=True):
                n = len(chunk.token_ids)
                if item.seq.seq_id in self._reqs:
                    self.draft.observe(item.seq, chunk.start, result.states[first : first + n])
                first += n
        if self._retiring:  # the step's finished requests may have been an unloading adapter's last
            self._retire_loras()
        took = time.monotonic() - started
        self.step_model.observe(sched.num_batched_tokens, took)
        self.stats.busy_s += took
        return outputs

    def _token_budget(self) -> int | None:
        """This step's token budget: what fits in the strictest TPOT target of the running
        decodes, by the measured step time (None: the configured budget). Where even a step of
        the decodes alone passes the target (they miss it whatever the budget), prefills may make
        the step at most twice that long: a floor of a few prefill tokens would only starve the
        prompts waiting behind them (a 500-token prompt at 16 tokens a step)."""
        if not self.config.tpot_budget:
            return None
        target = self.scheduler.tpot_target()
        line = self.step_model.line() if target is not None else None
        if target is None or line is None:
            return None
        decodes = len(self.scheduler.running)
        return line.tokens_within(max(target, 2 * line.seconds(decodes)))

    def _propose(self) -> None:
        """Proposals for this step's decoding requests (``Sequence.spec_token_ids``). A request
        speculates when: no more than ``disable_by_batch_size`` sequences are running (a large
        batch is compute-bound: verification rows would cost more than they save), with fewer
        tokens the more run (``batch_limit``); its last draft
        accepted something or its backoff has run out, and as many tokens as its last draft's
        acceptance suggests (``SpecBackoff``: the low-acceptance rules); it is not a pooling
        request. Proposals never run past ``max_tokens`` or the context limit, nor, for a guided
        request, past the first token its grammar refuses (walked on its matcher, rolled back)."""
        spec = self.speculative
        assert spec is not None
        running = self.scheduler.running
        allowed = len(running) <= spec.disable_by_batch_size
        k_batch = batch_limit(spec.num_speculative_tokens, len(running), spec.disable_by_batch_size)
        step = self.stats.steps
        items: list[DraftItem] = []
        for seq in running:
            seq.spec_token_ids = []
            if not allowed or seq.num_computed_tokens + 1 != seq.num_tokens:
                continue
            req = self._reqs.get(seq.seq_id)
            if req is None or seq.params.pooling or not req.backoff.allows(step):
                continue
            k = min(req.backoff.limit(k_batch), seq.params.max_tokens - len(seq.output_token_ids) - 1,
                    self.max_model_len - seq.num_tokens)
            if k > 0:
                items.append(DraftItem(seq, k))
        if self.draft is not None:
            for it, proposal in zip(items, self.draft.propose(items), strict=True):
                it.seq.spec_token_ids = proposal
        else:
            assert self._proposer is not None
            for it in items:
                it.seq.spec_token_ids = self._proposer.propose(it.seq.all_token_ids, it.k)
        if self._num_guided:  # a guided request's proposals stop where its grammar refuses one
            for it in items:
                guide = self._reqs[it.seq.seq_id].guide
                if guide is not None and it.seq.spec_token_ids:
                    del it.seq.spec_token_ids[guide.allowed_prefix(it.seq.spec_token_ids):]

    def _model_input(self, sched: SchedulerOutput) -> ModelInput:
        """The scheduler's decision with the KV manager's block tables: what the runner computes.
        With LoRA, the scheduled sequences are first grouped by adapter (a stable sort, in place:
        postprocessing reads the same list), so each adapter's rows are one contiguous segment and
        the layers' update slices instead of gathering (engine_workers/model/lora/layers.py).
        The order of a step's sequences changes nothing else: every draw is per sequence."""
        if self.lora is not None:
            first = {lo: i for i, lo in reversed(list(enumerate(item.seq.lora for item in sched.scheduled)))}
            sched.scheduled.sort(key=lambda item: first[item.seq.lora])
        now = time.monotonic()
        chunks: list[Chunk] = []
        verify: list[int] = []
        replay: list[int] = []
        prefill: list[int] = []
        for item in sched.scheduled:
            s = item.seq
            if s.times.first_scheduled is None:
                s.times.first_scheduled = now
                self.stats.prompt_tokens += s.num_prompt_tokens
            start = s.num_computed_tokens
            tokens = s.all_token_ids[start : start + item.num_new_tokens - item.num_spec]
            if item.num_spec:
                verify.append(len(chunks))
                tokens += s.spec_token_ids[: item.num_spec]
            elif item.replay:
                replay.append(len(chunks))
            elif len(tokens) == 1 and start < s.num_prompt_tokens:
                prefill.append(len(chunks))  # a prompt position: prefill, as in a longer chunk
            chunks.append(Chunk(tokens, start, self.kv.block_ids(s.seq_id), item.samples))
        hidden, sum_chunks = self.pooler.wants(sched.scheduled)
        loras = tuple(item.seq.lora for item in sched.scheduled) if self.lora is not None else ()
        return ModelInput(tuple(chunks), hidden=hidden, sum_chunks=sum_chunks, verify=tuple(verify),
                          replay=tuple(replay), prefill=tuple(prefill), loras=loras, states=isinstance(self.draft, MtpProposer))

    def _postprocess(self, sched: SchedulerOutput, batch: ModelInput, result: RunnerOutput,
                     outputs: list[RequestOutput]) -> None:
        """The forward's rows become outputs: embedding requests end with their vector (they end at
        their prefill: pooled, not sampled), every other request whose known tokens are all
        computed gets one sampled token, and finished requests release their blocks."""
        if result.sums is not None:
            self.pooler.add_sums(batch, [item.seq.seq_id for item in sched.scheduled], result.sums)
        # one logit row per sampling chunk, 1 + num_spec for a verification chunk (in chunk order)
        items = [item for item in sched.scheduled if item.samples]
        logits = result.logits
        if result.hidden is not None:  # pooling requests never speculate: their row is their own
            firsts = [0]
            for item in items:
                firsts.append(firsts[-1] + 1 + item.num_spec)
            pooled = [i for i, it in enumerate(items) if it.seq.params.pooling]
            if pooled:
                vectors = self.pooler.vectors([items[i].seq for i in pooled], result.hidden[[firsts[i] for i in pooled]])
                done = time.monotonic()
                for i, vec in zip(pooled, vectors, strict=True):
                    self._pooled(items[i].seq, vec, done, outputs)
                keep = [r for i, it in enumerate(items) if not it.seq.params.pooling
                        for r in range(firsts[i], firsts[i + 1])]
                logits = logits[keep]
                items = [it for it in items if not it.seq.params.pooling]
        # A verification chunk's row j draws as plain decoding would after the first j proposals:
        # output position and penalty / min_tokens state include them (sampler.SampleRow).
        rows: list[SampleRow] = []
        for item in items:
            s = item.seq
            rows.append(s)
            for j in range(1, item.num_spec + 1):
                rows.append(Row(s.params, s.seed, s.prompt_token_ids, s.output_token_ids + s.spec_token_ids[:j]))
        mask = None
        if self._num_guided and rows:
            # a request's first row is its Sequence; a verification chunk's proposal rows follow
            # it, masked with its grammar's state after the proposals before them (``ahead``)
            heads = [(i, s) for i, s in enumerate(rows) if isinstance(s, Sequence)]
            guided = [(i, g) for i, s in heads if (g := self._reqs[s.seq_id].guide) is not None]
            spec_of = {item.seq.seq_id: item.num_spec for item in items if item.num_spec}
            ahead = {i: s.spec_token_ids[: spec_of[s.seq_id]] for i, s in heads
                     if s.seq_id in spec_of and self._reqs[s.seq_id].guide is not None}
            if guided:
                def mask(x: torch.Tensor) -> None:
                    self._masks.apply(x, guided, ahead)
        drawn = self.sampler(logits, rows, mask) if rows else None
        now = time.monotonic()
        for item in sched.scheduled:
            if not item.samples:
                self._commit(item.seq)
        if drawn is None:  # None exactly when nothing samples
            return
        r = 0
        for item in items:
            if item.num_spec:
                self._verify(item, drawn.token_ids[r : r + 1 + item.num_spec], drawn.logprobs[r : r + 1 + item.num_spec],
                             now, outputs)
            else:
                self._append_token(item.seq, drawn.token_ids[r], drawn.logprobs[r], now, outputs)
            r += 1 + item.num_spec

    def _verify(self, item: ScheduledSeq, drawn: list[int], logprobs: list[TokenLogprobs | None], now: float,
                outputs: list) -> None:
        """Accept the proposals up to the first that differs from the target's draw there, then
        that draw; each token passes the stop checks as it comes. The K/V of the positions after
        the accepted tokens are rolled back (computed count, blocks past the known tokens)."""
        seq = item.seq
        proposed = seq.spec_token_ids[: item.num_spec]
        start = seq.num_computed_tokens - item.num_new_tokens  # the decode token's position
        accepted = 0
        finished = False
        for j, token in enumerate(drawn):
            # the K/V of the decode token and the j proposals before this draw are valid
            seq.num_computed_tokens = start + 1 + j
            finished = self._append_token(seq, token, logprobs[j], now, outputs)
            if j == len(proposed) or token != proposed[j]:
                break
            accepted += 1
            if finished:
                break
        self.stats.spec_num_drafts += 1
        self.stats.spec_num_draft_tokens += len(proposed)
        self.stats.spec_num_accepted_tokens += accepted
        seq.spec_token_ids = []
        if not finished:
            self._reqs[seq.seq_id].backoff.record(self.stats.steps, accepted, len(proposed))
            self.kv.truncate(seq.seq_id, seq.num_tokens)

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, now: float,
                      outputs: list) -> bool:
        """Append one sampled token; True when it finished the request (then its blocks are free)."""
        req = self._reqs[seq.seq_id]
        seq.output_token_ids.append(token)
        self.stats.generated_tokens += 1
        if seq.times.first_token is None:
            seq.times.first_token = now
        seq.times.last_token = now
        # The K/V of all but the new token are computed: register the full blocks they fill.
        self._commit(seq)
        p = seq.params
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = FinishReason.STOP
        elif req.detok.add(token):
            reason = FinishReason.STOP
        elif req.guide is not None and (not req.guide.accept(token) or req.guide.terminated):
            reason = FinishReason.STOP  # the grammar ended (or, never expected, refused a masked token)
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if logprobs is not None:
            req.pending_logprobs.append(logprobs)
        if reason is not None:
            del self._reqs[seq.seq_id]
            self.scheduler.remove(seq)
            self._finish(req, reason, now, outputs)
            return True
        offset = req.detok.released
        outputs.append(RequestOutput(
            seq.seq_id, len(seq.output_token_ids) - 1, (token,), req.detok.release(final=False), offset,
            self._take_logprobs(req), False, None, seq.num_prompt_tokens, seq.num_cached_tokens, len(seq.output_token_ids),
            seed=seq.seed,
        ))
        return False

    def _commit(self, seq: Sequence) -> None:
        """Register the full blocks of ``seq``'s computed tokens in the prefix cache (keyed by where
        its outputs begin: kv_store/hashing.py)."""
        self.kv.commit_computed(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens, seq.cache_extra,
                                seq.num_prompt_tokens)

    def _pooled(self, seq: Sequence, vector: tuple[float, ...], now: float, outputs: list) -> None:
        """An embedding request's prefill is done: it ends (``stop``, no output token) with its vector."""
        req = self._reqs.pop(seq.seq_id)
        self._commit(seq)
        self.scheduler.remove(seq)
        self._finish(req, FinishReason.STOP, now, outputs)
        last = outputs[-1]
        outputs[-1] = RequestOutput(last.request_id, last.seq, last.token_ids, last.text, last.text_offset, None,
                                    True, last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens, 0,
                                    last.times, last.seed, vector)

    def _take_logprobs(self, req: _Req) -> tuple[TokenLogprobs, ...] | None:
        if req.seq.params.logprobs is None:
            return None
        out, req.pending_logprobs = tuple(req.pending_logprobs), []
        return out

    def _finish(self, req: _Req, reason: str, now: float, outputs: list) -> None:
        seq = req.seq
        self.pooler.forget(seq.seq_id)
        if self.draft is not None:
            self.draft.forget(seq.seq_id)
        self._num_guided -= req.guide is not None
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        seq.times.finished = now
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        n = len(seq.output_token_ids)
        # The last token (if any) travels with the final output, unless the abort came between steps.
        new = (seq.output_token_ids[-1],) if n and reason != FinishReason.ABORT else ()
        offset = req.detok.released
        outputs.append(RequestOutput(
            seq.seq_id, n - len(new), new, req.detok.release(final=True), offset, self._take_logprobs(req),
            True, reason, seq.num_prompt_tokens, seq.num_cached_tokens, n, seq.times, seq.seed,
        ))

    # -- conveniences -----------------------------------------------------------------------------

    def generate(self, prompts: Seq[str | Seq[int]],
                 params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None = None,
                 cache_salt: str | None = None,
                 loras: Seq[str | None] | None = None) -> list[CompletedRequest]:
        """Run prompts to completion together (continuous batching) and return them in order.
        ``cache_salt``: prefix-cache namespace (as for ``add_request``); ``loras``: per prompt, its
        LoRA adapter (None: the base model)."""
        if loras is not None and len(loras) != len(prompts):
            raise ValueError(f"loras has {len(loras)} entries for {len(prompts)} prompts")
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params_list)):
            self.add_request(rid, prompt, p, cache_salt=cache_salt, lora=loras[i] if loras is not None else None)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        text: dict[str, list[str]] = {rid: [] for rid in ids}
        done: dict[str, RequestOutput] = {}
        reasons: dict[str, str] = {}
        prompt_ids = {rid: tuple(self._reqs[rid].seq.prompt_token_ids) for rid in ids}
        while len(done) < len(ids):
            for out in self.step():
                if out.request_id not in tokens:
                    continue
                tokens[out.request_id].extend(out.token_ids)
                text[out.request_id].append(out.text)
                if out.finished:
                    assert out.finish_reason is not None  # a finished output always says why
                    done[out.request_id] = out
                    reasons[out.request_id] = out.finish_reason
        return [
            CompletedRequest(rid, prompt_ids[rid], tuple(tokens[rid]), "".join(text[rid]), reasons[rid],
                             done[rid].num_cached_tokens, done[rid].seed)
            for rid in ids
        ]

    def add_lora(self, name: str, path: str) -> None:
        """Serve one more LoRA adapter from now on (vLLM's ``load_lora_adapter``); raises
        ``ValueError`` (a :class:`~engine_workers.model.lora.peft_config.LoraError`) naming what is wrong."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (--enable-lora)")
        if name in self._retiring:
            raise ValueError(f"LoRA adapter {name!r} is being unloaded; load it again once its requests finish")
        self.lora.add(name, path)
        self._unloaded.discard(name)

    def remove_lora(self, name: str, *, when_idle: bool = False) -> int:
        """Stop serving adapter ``name`` (vLLM's ``unload_lora_adapter``). While a waiting or
        running request names it: refused, or with ``when_idle`` new requests for it are refused
        and it goes once they finish. Returns how many requests still use it (0: gone now)."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (--enable-lora)")
        self.lora.check(name)
        users = sum(req.seq.lora == name for req in self._reqs.values())
        if users and not when_idle:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} request(s); unload it when they finish")
        self._unloaded.add(name)
        if users:
            self._retiring.add(name)
        else:
            self.lora.remove(name)
        return users

    def _retire_loras(self) -> None:
        """Remove the adapters being unloaded whose last request finished."""
        assert self.lora is not None
        busy = {req.seq.lora for req in self._reqs.values()}
        for name in [n for n in self._retiring if n not in busy]:
            self._retiring.discard(name)
            self.lora.remove(name)

    def lora_snapshot(self) -> dict:
        """``running_loras``, ``waiting_loras`` (sorted adapter names) and ``max_loras`` for the
        snapshot; empty without LoRA."""
        if self.lora is None:
            return {}
        running = {s.lora for s in self.scheduler.running if s.lora is not None}
        waiting = {s.lora for s in self.scheduler.waiting() if s.lora is not None}
        return dict(running_loras=tuple(sorted(running)), waiting_loras=tuple(sorted(waiting)),
                    max_loras=self.lora.max_loras)

    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def num_running(self) -> int:
        return len(self.scheduler.running)


def lora_manager(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device) -> LoraManager:
    """The engine's adapters (``config.lora_modules``) on ``loaded``'s layers (the config refused
    the weight formats and tensor parallelism the update cannot sit beside)."""
    return LoraManager(loaded.model, loaded.spec, dict(config.lora_modules), dtype=dtype, device=device,
                       max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                       max_cpu_loras=config.max_cpu_loras)
