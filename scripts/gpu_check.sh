#!/usr/bin/env bash
# The GPU check (moe_dist/bench/gpu_check.py) on one NVIDIA GPU, at most 8 minutes:
#   bash scripts/gpu_check.sh [OUTDIR]          # default OUTDIR: $OUT if set, else runs/gpu-check
# Python: $PYTHON if it has a CUDA torch, else python3 if it has one, else a .venv-gpu with
# torch==2.13.0 from PyPI (its Linux wheel is the CUDA build). GPU_CHECK_DEVICE=cpu runs it on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-runs/gpu-check}}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
mkdir -p "$OUTDIR"
has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
has_torch() { "$1" -c 'import torch' 2>/dev/null; }
PY=""
for cand in "${PYTHON:-}" python3 .venv/bin/python; do  # .venv: this project's CPU setup (the CPU mode)
  if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1; then
    if { [ "$DEVICE" = cpu ] && has_torch "$cand"; } || has_cuda "$cand"; then PY=$cand; break; fi
  fi
done
if [ -z "$PY" ]; then
  python3 -m venv .venv-gpu && .venv-gpu/bin/python -m pip install -q torch==2.13.0 && \
    .venv-gpu/bin/python -m pip install -q -e . || { echo "gpu_check: no CUDA torch could be installed" >&2; exit 1; }
  PY=.venv-gpu/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__)')), device $DEVICE, output $OUTDIR"
"$PY" -m moe_dist.bench.gpu_check --out "$OUTDIR" --device "$DEVICE" ${GPU_CHECK_SECTIONS:+--sections $GPU_CHECK_SECTIONS} \
  --budget-s "${GPU_CHECK_BUDGET_S:-450}"
