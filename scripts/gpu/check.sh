#!/usr/bin/env bash
# The CUDA check, run on a lent GPU machine from the repository root (docs/gpu.md says how to fill .gpu/):
#   .gpu/whl    wheels the machine lacks (aiokafka, websockets, orjson, pytest 9 + pytest-asyncio)
#   .gpu/smol   the default model's config.json and tokenizer files (its weights are too large to carry)
# Each stage is bounded and independent: one failing does not hide the others' results.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
stage() { echo; echo "=== $1 ($(date +%T))"; }

stage versions
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"

stage "gpu tests (warnings as errors, as in CI)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine_workers/engine/test_gpu.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"

stage "random weights at the default model's shape"
timeout 60 python3 scripts/gpu/random_like.py .gpu/smol /tmp/smol || exit 1

stage "bench engine: lockgate vs HF static vs HF continuous, bf16 on cuda"
timeout 150 python3 -m benchmarks --log-level WARNING bench engine --model /tmp/smol --device cuda --kv-cache-bytes 8G --num-requests 128 2>&1 | tee "$OUT/bench_engine.log" | tail -12

stage "bench engine: lockgate alone, larger batches"
for seqs in 64 256; do
  timeout 120 python3 -m benchmarks --log-level WARNING bench engine --model /tmp/smol --device cuda --kv-cache-bytes 8G --num-requests 512 --skip-hf \
    --max-num-seqs $seqs --max-num-batched-tokens $((seqs * 16)) 2>&1 | tee "$OUT/bench_engine_seqs$seqs.log" | head -4
done

stage "bench e2e: memory bus + worker vs in-process, cuda"
timeout 120 python3 -m benchmarks --log-level WARNING bench e2e --model /tmp/smol --device cuda --kv-cache-bytes 8G --bus memory:// --num-requests 128 --repeat 2 \
  2>&1 | tee "$OUT/bench_e2e.log" | tail -14
stage done
