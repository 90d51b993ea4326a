#!/usr/bin/env bash
# The CUDA probe (scripts/gpu/probe.py), run on a lent GPU machine from the repository root; needs
# .gpu/ as scripts/gpu/check.sh does. Prints bf16 numerics and per-variant step times; cProfile
# listings of each variant's third run go to $OUT.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
quiet() { grep -v "Writing model\|Loading weights"; }
echo "=== models ($(date +%T))"
timeout 60 python3 scripts/gpu/random_like.py .gpu/smol /tmp/smol 2>&1 | quiet
timeout 60 python3 -m lockgate.cli --log-level WARNING model tiny /tmp/tiny 2>&1 | quiet
echo "=== speed ($(date +%T))"
for v in base onegroup+nocudnn nocudnn onegroup; do
  timeout 100 python3 scripts/gpu/probe.py speed /tmp/smol $v "$OUT/prof_$v.txt" 2>&1 | quiet
done
echo "=== numerics: relative L2 error of next-token logits against HF fp32 on the GPU ($(date +%T))"
for m in tiny smol; do echo "-- $m"; timeout 60 python3 scripts/gpu/probe.py numerics /tmp/$m 2>&1 | quiet; done
echo "=== done ($(date +%T))"
