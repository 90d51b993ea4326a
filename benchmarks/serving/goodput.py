"""``lockgate bench goodput``: vLLM's own serving client against ``lockgate serve`` and ``vllm serve``.

Issue #52's measurement. vLLM's client (``vllm bench serve``, random dataset, streaming
``/v1/completions``, ``--goodput ttft:500 tpot:50``) is run at rising request rates against:

* ``lockgate serve`` as users start it: no scheduling flags (only free ports, and ``--keys`` in the
  mixed-tier run, where one key must be allowed p0);
* ``vllm serve`` on the CPU (``--vllm-dtype``, bf16 by default; the environment the anchors'
  ``anchor_vllm.py`` sets: ``VLLM_CPU_OMP_THREADS_BIND`` (``--vllm-omp-bind``, 0-1), a 1 GiB KV
  cache, tcmalloc preloaded, offline).

Then a **mixed-tier run** on lockgate: a saturating p2 batch load (``priority`` 2, unbounded rate,
``--p2-concurrency`` in flight) alone, then again with p0 chat (``priority`` 0) at ``--p0-rate``
beside it: p0 goodput and TTFT/TPOT p99, p2 output throughput against p2 alone.

Each server is started, warmed by vLLM's client (``--num-warmups``), measured and stopped; the
load average is read beside every run. Writes ``results.json`` (every run's vLLM result, trimmed of
per-request arrays, with its load) and ``latency_vs_rate.png`` / ``goodput_vs_rate.png`` /
``mixed_tier.png`` into ``--out``. The orchestration (processes, files) lives here; the numbers are
vLLM's client's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

SLO = {"ttft": 500.0, "tpot": 50.0}  # the design guide's P99 targets, ms
KEEP = ("completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
        "total_input_tokens", "total_output_tokens", "request_rate", "max_concurrency")
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "lockgate" / "models" / "smollm2-135m-instruct"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-cli", default=os.environ.get("LOCKGATE_VLLM_CLI", "vllm"),
                   help="vLLM's CLI (e.g. the anchors' vllm_cli.sh) [LOCKGATE_VLLM_CLI]")
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR),
                   help="HF folder of the default model: vLLM serves it, both clients tokenize with it")
    p.add_argument("--rates", default="1,2,4,8", help="request rates, req/s (Poisson arrivals)")
    p.add_argument("--num-prompts", type=int, default=30, help="requests per rate")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (vLLM's random dataset)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos: exactly this many)")
    p.add_argument("--num-warmups", type=int, default=4, help="vLLM client warm-up requests before each server's first rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--servers", default="lockgate,vllm",
                   help="which to measure at the rates: lockgate, vllm, both, or '' (none: only the mixed-tier run); "
                        "results.json in --out keeps the other servers' rows of earlier runs")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--vllm-omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (as anchor_vllm.py --omp-bind)")
    p.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True, help="the mixed-tier run on lockgate")
    p.add_argument("--p0-rate", type=float, default=1.0, help="mixed-tier: p0 chat requests per second")
    p.add_argument("--p0-prompts", type=int, default=30, help="mixed-tier: p0 requests")
    p.add_argument("--p2-prompts", type=int, default=96, help="mixed-tier: p2 requests (sent as fast as allowed)")
    p.add_argument("--p2-concurrency", type=int, default=16, help="mixed-tier: p2 requests in flight")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to answer /v1/models")
    p.add_argument("--out", default="bench-goodput", help="folder for results.json and the PNGs")
    p.add_argument("--logs", default=None, help="folder for the servers' stderr (default: OUT/logs)")


def run(args: argparse.Namespace) -> int:
    # a SIGTERM (e.g. from `timeout`) unwinds like an exception, so the servers started are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    logs = Path(args.logs) if args.logs else out / "logs"
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    if not Path(args.model_dir).is_dir():
        print(f"lockgate bench goodput: no model folder {args.model_dir} (--model-dir)", file=sys.stderr)
        return 2
    if shutil.which(args.vllm_cli) is None:
        print(f"lockgate bench goodput: vLLM's CLI {args.vllm_cli!r} not found (--vllm-cli)", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in servers if s not in ("lockgate", "vllm")]
    if bad or not rates:
        print(f"lockgate bench goodput: --servers takes lockgate and/or vllm (got {bad}); --rates at least one",
              file=sys.stderr)
        return 2
    path = out / "results.json"
    result: dict = json.loads(path.read_text()) if path.exists() else {}
    result.update(slo_ms=SLO, host=_host())
    result.setdefault("invocations", []).append({**{k: v for k, v in vars(args).items() if k != "func"},
                                                 "date": result["host"]["date"]})
    for name in servers:
        with _server(name, args, logs) as (url, model):
            result.setdefault("rates", {})[name] = [
                _bench(args, url, model, out / "raw" / f"{name}-rate{r:g}.json", rate=r, n=args.num_prompts,
                       warmups=args.num_warmups if i == 0 else 0)
                for i, r in enumerate(rates)]
        path.write_text(json.dumps(result, indent=2))
    if args.mixed:
        result["mixed"] = _mixed(args, out, logs)
        path.write_text(json.dumps(result, indent=2))
    result["ratios"] = ratios(result.get("rates", {}))
    path.write_text(json.dumps(result, indent=2))
    from benchmarks.serving.goodput_plots import plot_all

    plot_all(result, out)
    print(format_summary(result))
    return 0


# -- the servers ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(name: str, args: argparse.Namespace, logs: Path, extra: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """Start ``lockgate serve`` or ``vllm serve``; yield (base URL, served model name) once it answers."""
    port = _free_port()
    env = dict(os.environ)
    if name == "lockgate":
        cmd = [sys.executable, "-m", "benchmarks", "serve", "--port", str(_free_port()), "--openai-port", str(port), *extra]
    else:
        cmd = [args.vllm_cli, "serve", args.model_dir, "--dtype", args.vllm_dtype, "--host", "127.0.0.1",
               "--port", str(port), *extra]
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=args.vllm_omp_bind, HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        anchors = Path(os.environ.get("ANCHORS_DIR", Path.home() / ".cache" / "lockgate-anchors"))
        env.setdefault("VLLM_CACHE_ROOT", str(anchors / "cache" / "vllm"))  # anchor_vllm.py's compile cache
        tcmalloc = sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so.4*"))
        if tcmalloc and "libtcmalloc" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(x for x in (str(tcmalloc[0]), env.get("LD_PRELOAD", "")) if x)
    log = (logs / f"{name}-serve.log").open("ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        model = _wait_ready(proc, url, args.start_timeout, logs / f"{name}-serve.log")
        yield url, model
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: Path) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it answered; see {log}")
        try:
            # a server started with a key file answers /v1/models only to a key (the mixed-tier run)
            key = os.environ.get("OPENAI_API_KEY")
            req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.load(r)["data"][0]["id"]
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"the server did not answer {url}/v1/models within {timeout:.0f}s; see {log}")


# -- vLLM's client ----------------------------------------------------------------------------


def _bench_cmd(args: argparse.Namespace, url: str, model: str, result: Path, rate: float, n: int,
               warmups: int = 0, body: dict | None = None, concurrency: int | None = None) -> list[str]:
    cmd = [args.vllm_cli, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", model, "--tokenizer", args.model_dir, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(n), "--request-rate", "inf" if rate == float("inf") else f"{rate:g}",
           "--ignore-eos", "--seed", str(args.seed), "--num-warmups", str(warmups),
           "--goodput", *(f"{k}:{v:g}" for k, v in SLO.items()),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name,
           "--disable-tqdm"]
    if body:
        cmd += ["--extra-body", json.dumps(body)]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    return cmd


def _bench(args: argparse.Namespace, url: str, model: str, result: Path, **kw) -> dict:
    result.parent.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    proc = subprocess.run(_bench_cmd(args, url, model, result, **kw), capture_output=True, text=True,
                          env=_client_env(), timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return summarize(json.loads(result.read_text()), load0, os.getloadavg()[0])


def _client_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.pop("LD_PRELOAD", None)
    return env


def summarize(raw: dict, load_before: float, load_after: float) -> dict:
    """The fields kept of one vLLM result (no per-request arrays), and the 1-minute load average
    before and after the run."""
    row = {k: raw.get(k) for k in KEEP}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            row[f"{stat}_{metric}_ms"] = raw.get(f"{stat}_{metric}_ms")
    done = raw.get("completed") or 0
    row["good_share"] = (raw.get("request_goodput") or 0) * (raw.get("duration") or 0) / done if done else 0.0
    errors = [e for e in raw.get("errors") or () if e]  # --save-detailed: why requests failed
    row["errors"] = sorted({e.strip().splitlines()[0][:200] for e in errors})[:5]
    row["load_1m"] = [round(load_before, 2), round(load_after, 2)]
    row["date"] = raw.get("date") or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return row


# -- the mixed-tier run -----------------------------------------------------------------------


def _mixed(args: argparse.Namespace, out: Path, logs: Path) -> dict:
    """p2 alone, then p2 with p0 beside it, on one ``lockgate serve`` whose one key may use p0."""
    from edge.config import add_key

    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.jsonl"
        key, _ = add_key(keys, "bench", 0, requests_per_min=0, tokens_per_min=0, max_streams=0)
        os.environ["OPENAI_API_KEY"] = key  # vLLM's client sends it as the bearer token
        try:
            with _server("lockgate", args, logs, extra=("--keys", str(keys))) as (url, model):
                p2 = dict(rate=float("inf"), n=args.p2_prompts, body={"priority": 2}, concurrency=args.p2_concurrency)
                solo = _bench(args, url, model, out / "raw" / "mixed-p2-solo.json", warmups=args.num_warmups, **p2)
                load0 = os.getloadavg()[0]
                raw_p2 = out / "raw" / "mixed-p2.json"
                bg = subprocess.Popen(_bench_cmd(args, url, model, raw_p2, **p2), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, env=_client_env())
                time.sleep(3.0)  # the p2 load builds up first
                p0 = _bench(args, url, model, out / "raw" / "mixed-p0.json", rate=args.p0_rate, n=args.p0_prompts,
                            body={"priority": 0})
                _, err = bg.communicate(timeout=900)
                if bg.returncode != 0:
                    raise RuntimeError(f"the p2 load failed ({bg.returncode}): {err[-2000:]}")
                beside = summarize(json.loads(raw_p2.read_text()), load0, os.getloadavg()[0])
        finally:
            os.environ.pop("OPENAI_API_KEY", None)
    share = (beside["output_throughput"] or 0) / solo["output_throughput"] if solo["output_throughput"] else 0.0
    return {"p2_solo": solo, "p2_with_p0": beside, "p0": p0, "p2_throughput_share": share,
            "p0_rate": args.p0_rate, "p2_concurrency": args.p2_concurrency}


# -- the figures ------------------------------------------------------------------------------


def ratios(rates: dict) -> list[dict]:
    """lockgate's goodput over vLLM's at each rate both were measured at (None where vLLM's is 0)."""
    mine = {r["request_rate"]: r for r in rates.get("lockgate", [])}
    out = []
    for v in rates.get("vllm", []):
        m = mine.get(v["request_rate"])
        if m is None:
            continue
        g = v["request_goodput"] or 0.0
        out.append({"rate": v["request_rate"], "lockgate_goodput": m["request_goodput"], "vllm_goodput": g,
                    "ratio": m["request_goodput"] / g if g else None,
                    "lockgate_good_share": m["good_share"], "vllm_good_share": v["good_share"]})
    return out


def format_summary(result: dict) -> str:
    lines = ["server rate | done | goodput req/s (share) | TTFT p50/p99 ms | TPOT p50/p99 ms | load 1m"]
    for name, rows in result.get("rates", {}).items():
        for r in rows:
            lines.append(f"{name} {r['request_rate']} | {r['completed']} | {r['request_goodput']:.2f} "
                         f"({r['good_share']:.0%}) | {r['median_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} | "
                         f"{r['median_tpot_ms']:.1f}/{r['p99_tpot_ms']:.1f} | {r['load_1m']}")
    for q in result.get("ratios", []):
        lines.append(f"rate {q['rate']}: lockgate/vLLM goodput {q['ratio'] if q['ratio'] is None else round(q['ratio'], 2)}")
    m = result.get("mixed")
    if m:
        p0 = m["p0"]
        lines.append(f"mixed: p0 goodput {p0['request_goodput']:.2f} req/s ({p0['good_share']:.0%} of "
                     f"{p0['completed']}), TTFT p99 {p0['p99_ttft_ms']:.0f} ms, TPOT p99 {p0['p99_tpot_ms']:.1f} ms; "
                     f"p2 {m['p2_with_p0']['output_throughput']:.1f} vs solo {m['p2_solo']['output_throughput']:.1f} "
                     f"tok/s ({m['p2_throughput_share']:.0%})")
    return "\n".join(lines)


def _host() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    return {"cpu": model, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
