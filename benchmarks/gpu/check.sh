#!/usr/bin/env bash
# The GPU check of issue 15, for the H200 lent through the `device` tool (about 8 minutes).
# Prepare here (x86-64, Python 3.12 wheels for the device's torch 2.11):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl \
#     flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.12
# then: run(command="bash benchmarks/gpu/check.sh", carry=[".whl"], timeout_s=540).
# Without .whl it still runs, with the torch reference backend (FlashInfer parity skipped).
set -uo pipefail
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
OUT="${OUT:-/tmp/gpu-check}"
timeout 480 python3 -m benchmarks.gpu.check --out "$OUT" 2>&1 | tee "$OUT.log"
cp "$OUT.log" "$OUT/" 2>/dev/null || true
