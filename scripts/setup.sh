#!/usr/bin/env bash
# Set up moe_dist on a fresh Debian machine: a virtual environment in .venv with the
# CPU build of torch (pinned; an unpinned torch pulls a multi-GB CUDA build), the
# package, its dev tools and the default corpus (Debian's python3.11-doc).
#   bash scripts/setup.sh            # CPU (torch from local disk or PyPI CPU wheel)
#   TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh   # GPU
# Extras: EXTRAS=dev,deepspeed,mpi,megatron,wandb bash scripts/setup.sh   (megatron: megatron-core for
#   moe_dist.integrations.megatron; wandb: log.wandb tracking; deepspeed: its CPU op is compiled here
#   when g++ exists; DS_PREBUILD=0 skips that and DeepSpeed compiles it at first use instead)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-dev}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
if [ -n "${TORCH_INDEX:-}" ]; then
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" --index-url "$TORCH_INDEX"
else
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
fi
case ",$EXTRAS," in
  *,deepspeed,*)  # compile DeepSpeed's CPU communication op now, not at the first deepspeed.init_distributed
    DS_SPEC=$(grep -o 'deepspeed==[0-9.]*' setup.py | head -n 1)
    if [ "${DS_PREBUILD:-1}" = 1 ] && command -v g++ >/dev/null 2>&1 \
        && ! "$VENV/bin/python" -m pip show deepspeed 2>/dev/null | grep -qx "Version: ${DS_SPEC#deepspeed==}"; then
      "$VENV/bin/python" -m pip install -q ninja
      DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 "$VENV/bin/python" -m pip install -q --no-cache-dir --no-build-isolation "$DS_SPEC"
    fi ;;
esac
"$VENV/bin/python" -m pip install -q -e ".[${EXTRAS}]"

# Default corpus: reStructuredText sources of the Python 3.11 documentation (PSF licence).
if [ ! -d /usr/share/doc/python3.11/html/_sources ] && [ "${SKIP_CORPUS:-0}" != 1 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends python3.11-doc >/dev/null
  else
    echo "note: install Debian's python3.11-doc (as root) for the default corpus, or set data.corpus" >&2
  fi
fi
echo "moe_dist ready in $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
