#!/usr/bin/env bash
# Issue #33's device check, for a session lent a GPU (docs/gpu.md, "Device check"). From the
# repository root, with .gpu/ filled as docs/gpu.md says (wheels the machine lacks, the default
# model's config and tokenizer). Every stage is bounded (about 7 minutes in all, under the 8 the
# issue allows) and independent; everything it finds goes to $OUT.
#   1. the gpu-marked tests: test_gpu.py and test_cudagraph_gpu.py (CUDA graph replay == eager
#      on the same padded inputs, bit for bit; greedy tokens with graphs == --enforce-eager in fp32;
#      the memory gauge; the bench's step breakdown)
#   2. bench engine at the default model's shape (random weights), lockgate alone, back to back on
#      the same card: CUDA graphs on (the default), then --enforce-eager; each prints tok/s and the
#      per-forward host vs device breakdown
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/device-check}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
  || { echo "no .gpu/whl wheels (docs/gpu.md)" | tee "$OUT/error.txt"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site
stage() { echo; echo "=== $1 ($(date +%T))"; }

stage versions
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  date -u; } 2>&1 | tee "$OUT/versions.txt"

stage "gpu tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
  tests/engine_workers/engine/test_gpu.py tests/engine_workers/model/test_cudagraph_gpu.py 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"

stage "random weights at the default model's shape"
timeout 60 python3 scripts/gpu/random_like.py .gpu/smol /tmp/smol 2>&1 | tail -3 || exit 1

for mode in graphs eager; do
  stage "bench engine, lockgate alone, bf16 on cuda, $mode"
  extra=(); [ "$mode" = eager ] && extra=(--enforce-eager)
  timeout 120 python3 -m benchmarks --log-level INFO bench engine --model /tmp/smol --device cuda --kv-cache-bytes 8G \
    --num-requests 128 --skip-hf --no-ablation "${extra[@]}" 2>"$OUT/bench_$mode.stderr" | tee "$OUT/bench_$mode.log" | tail -8
  grep -h "CUDA graphs" "$OUT/bench_$mode.stderr" | tail -3
done
stage done
