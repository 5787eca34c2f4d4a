#!/usr/bin/env bash
# The GPU check, one command: the CUDA tests (`pytest -m gpu`) and the GPU benchmark (bench/gpu.py),
# their logs and results written into OUT. On the GPU machine (see docs/testing.md#a-gpu-box):
#
#   scripts/gpu_check.sh "$OUT"              # wheels from .whl/ (scripts/gpu_wheels.sh), then the check
#   scripts/gpu_check.sh --cpu OUT           # the same steps on CPU, tiny shapes: checks this script (CI runs it)
#
# Budget on the GPU machine: under 9 minutes. Each part has its own bound (GPU_TESTS_S, GPU_BENCH_S), so a
# hang in one still leaves the other's results and a log that names where it stopped (SIGTERM dumps stacks).
set -uo pipefail
cd "$(dirname "$0")/.."
CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
OUT=${1:?usage: scripts/gpu_check.sh [--cpu] OUT}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ "$CPU" = 0 ] && [ -d .whl ]; then  # what the GPU machine lacks, at our versions (scripts/gpu_wheels.sh)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/galley-site \
        .whl/*.whl > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
    export PYTHONPATH=/tmp/galley-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    date -u
    git rev-parse --short HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
status=0
# -p no:cacheprovider: the tree may be read-only there; the GPU tests only (they skip without CUDA)
timeout -s TERM "${GPU_TESTS_S:-250}" $PY -m pytest -v -m gpu -p no:cacheprovider tests/engine/test_gpu.py \
    --durations=10 --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1 || status=1
grep -E "(PASSED|FAILED|ERROR)( |$)" "$OUT/pytest.log" | grep -v PASSED | cut -c1-300
tail -n 3 "$OUT/pytest.log"
if [ "$CPU" = 1 ]; then
    $PY bench/gpu.py --cpu --json "$OUT/gpu_bench.json" > "$OUT/bench.log" 2>&1 || status=1
else
    timeout -s TERM "${GPU_BENCH_S:-270}" $PY bench/gpu.py --json "$OUT/gpu_bench.json" > "$OUT/bench.log" 2>&1 \
        || status=1
fi
grep -E '^\{' "$OUT/bench.log" | cut -c1-600 || tail -n 20 "$OUT/bench.log"
exit $status
