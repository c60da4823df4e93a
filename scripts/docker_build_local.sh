#!/usr/bin/env bash
# Build docker/Dockerfile.cpu without an image registry or download.pytorch.org:
#   - base image: the local Debian bookworm made by scripts/docker_engine.sh ($BASE_IMAGE);
#   - torch: the CPU wheel on this machine's disk (pip's find-links: $PIP_FIND_LINKS or `pip config`,
#     or $WHEEL_DIR), served to the build over HTTP on 127.0.0.1 (so it never lands in a layer);
#   - CA certificates added locally (/usr/local/share/ca-certificates/*.crt) are trusted in the build,
#     for a TLS-inspecting proxy in front of PyPI. Other packages come from PyPI (or $PIP_INDEX_URL).
#   bash scripts/docker_build_local.sh [TAG] [docker build options ...]     # TAG default moe-dist:cpu
# Exit 3 when no local torch wheel is found (nothing is built then).
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-moe-dist:cpu}
shift $(( $# > 0 ? 1 : 0 ))
BASE_IMAGE=${BASE_IMAGE:-local/debian:bookworm}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}
TORCH_VERSION=$(sed -n 's/^TORCH_SPEC=\${TORCH_SPEC:-torch==\([0-9.]*\)}$/\1/p' scripts/setup.sh)
WHEEL_NAME="torch-${TORCH_VERSION}+cpu-cp311-cp311-*.whl"  # bookworm's and python:3.11-slim's Python

dirs=${WHEEL_DIR:-}
if [ -z "$dirs" ]; then
  dirs="${PIP_FIND_LINKS:-} $("$PY" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr '\n' ' ')"
fi
wheel=""
for d in $dirs; do
  d=${d#file://}
  for w in "$d"/$WHEEL_NAME; do
    [ -f "$w" ] && { wheel=$w; break 2; }
  done
done
if [ -z "$wheel" ]; then
  echo "docker_build_local: no $WHEEL_NAME in pip's find-links (${dirs// /, }); set WHEEL_DIR" >&2
  exit 3
fi

SERVE=$(mktemp -d "${TMPDIR:-/tmp}/moe-dist-wheels.XXXXXX")
ln -s "$(readlink -f "$wheel")" "$SERVE/"
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PY" -m http.server "$PORT" --bind 127.0.0.1 --directory "$SERVE" >/dev/null 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; rm -rf "$SERVE"' EXIT
for _ in $(seq 50); do
  "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/')" 2>/dev/null && break
  sleep 0.1
done

CA=""
for c in /usr/local/share/ca-certificates/*.crt; do
  [ -f "$c" ] && CA+="$(cat "$c")"$'\n'
done

echo "building $TAG on $BASE_IMAGE with $(basename "$wheel")" >&2
docker build --network host -f docker/Dockerfile.cpu -t "$TAG" \
  --build-arg BASE_IMAGE="$BASE_IMAGE" \
  --build-arg PIP_FIND_LINKS="http://127.0.0.1:$PORT/" \
  --build-arg TORCH_SPEC="torch==${TORCH_VERSION}+cpu" --build-arg TORCH_INDEX= \
  --build-arg EXTRA_CA_CERTS="$CA" \
  "$@" .
