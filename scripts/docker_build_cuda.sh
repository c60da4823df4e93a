#!/usr/bin/env bash
# Build docker/Dockerfile.cuda without an image registry: on the local Debian bookworm base that
# scripts/docker_engine.sh makes ($BASE_IMAGE), torch and its nvidia-* packages (CUDA, cuDNN, NCCL)
# from PyPI (or $PIP_INDEX_URL), the build on the host's network (--network host). CA certificates
# added locally (/usr/local/share/ca-certificates/*.crt) are trusted in the build, for a TLS-inspecting
# proxy in front of PyPI. About 3 GB are downloaded; the image is about 6 GB.
#   bash scripts/docker_build_cuda.sh [TAG] [docker build options ...]     # TAG default moe-dist:cuda
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-moe-dist:cuda}
shift $(( $# > 0 ? 1 : 0 ))
BASE_IMAGE=${BASE_IMAGE:-local/debian:bookworm}

CA=""
for c in /usr/local/share/ca-certificates/*.crt; do
  [ -f "$c" ] && CA+="$(cat "$c")"$'\n'
done

echo "building $TAG from docker/Dockerfile.cuda on $BASE_IMAGE, torch from PyPI" >&2
# PIP_FIND_LINKS= : this machine's wheel directories (a CPU torch among them) are not the build's
docker build --network host -f docker/Dockerfile.cuda -t "$TAG" \
  --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg EXTRA_CA_CERTS="$CA" --build-arg PIP_FIND_LINKS= \
  "$@" .
