#!/usr/bin/env bash
# The first run on a GPU (benchmarks/gpu_check/), 8 minutes at most in all:
#   bash scripts/gpu_check.sh [OUTDIR]      # OUTDIR: default $OUT if set, else runs/gpu-check
# OUTDIR receives gpu_check.json, gpu_check.md, sections.log and gpu_check.log (this output);
# the runs go to GPU_CHECK_WORK (default runs/gpu-check-work).
#
# Python: if ${PYTHON:-python3} has a torch that sees CUDA, a .venv-gpu on top of it
# (--system-site-packages; this package installed editable, offline) or, if that cannot be made,
# that interpreter itself with PYTHONPATH=<repo>. Without such a torch: a .venv-gpu with
# torch==2.13.0 from PyPI (its Linux wheel is the CUDA build) and this package (needs the network).
# GPU_CHECK_DEVICE=cpu: the same check on the CPU at small sizes with ${PYTHON:-.venv/bin/python}.
# Also: GPU_CHECK_SECTIONS=a,b (a subset), GPU_CHECK_TOTAL_S (default 480: the whole script's time).
set -uo pipefail

OUTDIR=${1:-${OUT:-runs/gpu-check}}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)  # absolute before moving to the repository
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
DEVICE=${GPU_CHECK_DEVICE:-cuda}
TOTAL_S=${GPU_CHECK_TOTAL_S:-480}
WORK=${GPU_CHECK_WORK:-runs/gpu-check-work}
VENV=.venv-gpu
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

say() { echo "gpu_check.sh: $*"; }
# `timeout SECONDS cmd...` where coreutils' timeout exists, else the command alone
tmo() { if command -v timeout >/dev/null 2>&1; then timeout "$@"; else shift; "$@"; fi; }
has_cuda() { tmo 60 "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
has_torch() { tmo 60 "$1" -c 'import torch' >/dev/null 2>&1; }
torch_of() { "$1" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -n 1; }

# A venv made by a venv's python sees the *base* interpreter's site-packages, not that venv's: when
# torch is then missing, the parent's site-packages directories are added by a .pth file.
overlay_venv() {
  local base=$1
  if [ -x "$VENV/bin/python" ] && has_cuda "$VENV/bin/python"; then say "reusing $VENV"; return 0; fi
  rm -rf "$VENV"
  tmo 60 "$base" -m venv --system-site-packages "$VENV" \
    || tmo 60 "$base" -m venv --system-site-packages --without-pip "$VENV" || return 1
  if ! has_torch "$VENV/bin/python"; then
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    "$base" -c 'import site, sys; print("\n".join(site.getsitepackages() + [p for p in sys.path if p.endswith("-packages")]))' \
      > "$site/_gpu_check_parent_site.pth" || return 1
  fi
  has_cuda "$VENV/bin/python" || { say "$VENV does not see CUDA through $base's packages"; return 1; }
  if "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then  # offline: no index, no dependencies, no build env
    tmo 60 "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
      || say "the editable install failed (its error is above); PYTHONPATH=$ROOT is used instead"
  fi
  return 0
}

# No torch with CUDA here: a fresh venv with PyPI's torch (the CUDA build on Linux) and the package.
torch_venv() {
  local base=$1
  rm -rf "$VENV"
  "$base" -m venv "$VENV" \
    && "$VENV/bin/python" -m pip install -q --retries 1 --timeout 30 "torch==2.13.0" \
    && "$VENV/bin/python" -m pip install -q --retries 1 --timeout 30 -e . \
    && has_cuda "$VENV/bin/python"
}

choose_python() {
  if [ "$DEVICE" = cpu ]; then
    PY=${PYTHON:-.venv/bin/python}
    [ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1 || PY=python3
    has_torch "$PY" || { say "GPU_CHECK_DEVICE=cpu: $PY has no torch (run scripts/setup.sh or set PYTHON)"; return 1; }
    say "GPU_CHECK_DEVICE=cpu: $PY ($(torch_of "$PY")), PYTHONPATH=$ROOT"
    return 0
  fi
  local base=${PYTHON:-python3}
  command -v "$base" >/dev/null 2>&1 || { say "no $base on PATH (set PYTHON)"; return 1; }
  if has_cuda "$base"; then
    if overlay_venv "$base"; then
      PY=$VENV/bin/python
      say "$base has a CUDA torch: $PY on top of it ($(torch_of "$PY")), PYTHONPATH=$ROOT"
    else
      PY=$base
      say "$base has a CUDA torch; no $VENV could be made: $PY itself ($(torch_of "$PY")), PYTHONPATH=$ROOT"
    fi
    return 0
  fi
  say "$base has no torch that sees CUDA ($(torch_of "$base")): installing torch==2.13.0 into $VENV from PyPI"
  if torch_venv "$base"; then
    PY=$VENV/bin/python
    say "$PY ($(torch_of "$PY"))"
    return 0
  fi
  say "no torch with CUDA could be installed (no network, or no GPU driver); nothing was checked"
  return 1
}

main() {
  say "$(date -u '+%Y-%m-%d %H:%M:%S') UTC, repository $ROOT, device $DEVICE, output $OUTDIR"
  choose_python || return 1
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  # what is left of the total after the environment, less a margin for the end (capped at 450 s)
  local budget=$(( TOTAL_S - SECONDS - 25 ))
  [ "$budget" -gt 450 ] && budget=450
  [ "$budget" -lt 30 ] && budget=30
  say "environment ready after ${SECONDS} s; sections get ${budget} s"
  local args=(--out "$OUTDIR" --work "$WORK" --device "$DEVICE" --budget-s "$budget")
  [ -n "${GPU_CHECK_SECTIONS:-}" ] && args+=(--sections "$GPU_CHECK_SECTIONS")
  # the check stops itself within its budget; timeout only guards against a hang (SIGTERM: it keeps what finished)
  if command -v timeout >/dev/null 2>&1; then
    timeout --preserve-status -k 10 $(( budget + 15 )) "$PY" -m benchmarks.gpu_check "${args[@]}"
  else
    "$PY" -m benchmarks.gpu_check "${args[@]}"
  fi
  local rc=$?
  say "done in ${SECONDS} s (exit $rc); $OUTDIR: $(cd "$OUTDIR" && ls | tr '\n' ' ')"
  return "$rc"
}

: > "$OUTDIR/gpu_check.log"
main 2>&1 | tee -a "$OUTDIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
