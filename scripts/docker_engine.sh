#!/usr/bin/env bash
# Get a Docker engine and a local Debian bookworm base image on a machine that cannot reach an
# image registry (what .ci/run and tests/test_docker_image.py use):
#   1. `docker info` works already, or (as root) Debian's docker.io and debootstrap are installed
#      with apt-get and dockerd is started in the background (log: $DOCKERD_LOG);
#   2. the base image $BASE_IMAGE exists already, or it is made with
#      `debootstrap --variant=minbase bookworm` from the Debian mirror this machine's apt uses
#      (or $DEBIAN_MIRROR) and imported with `docker import`.
#   bash scripts/docker_engine.sh        # prints the base image name; exit 1 + the reason on stderr otherwise
set -uo pipefail
BASE_IMAGE=${BASE_IMAGE:-local/debian:bookworm}
DOCKERD_LOG=${DOCKERD_LOG:-${TMPDIR:-/tmp}/moe-dist-dockerd.log}

fail() { echo "docker_engine: $*" >&2; exit 1; }

# the URI of the Debian archive that serves bookworm in /etc/apt/sources.list* (one-line or deb822 format)
debian_mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                       if ($(i + 1) == "bookworm") { print $i; exit } }' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    awk 'BEGIN { RS = ""; FS = "\n" }
         { uri = ""; ok = 0; deb = 0
           for (j = 1; j <= NF; j++) {
             if ($j ~ /^URIs:/) { split($j, w, " "); uri = w[2] }
             if ($j ~ /^Suites:/ && (" " $j " ") ~ / bookworm /) ok = 1
             if ($j ~ /^Types:/ && $j ~ / deb( |$)/) deb = 1 }
           if (ok && deb && uri != "") { print uri; exit } }' "$f"
  done
}

if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || fail "no Docker engine answers (docker info) and starting one needs root"
  if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    command -v apt-get >/dev/null || fail "dockerd/debootstrap are missing and there is no apt-get"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap; } >/dev/null \
      || fail "apt-get install docker.io debootstrap failed"
  fi
  # dockerd sets the iptables FORWARD policy to DROP, which silently drops traffic between network
  # namespaces on other bridges of this machine (the multi-node tests' nodes); its own containers are
  # let through by its explicit rules, so the policy it found is put back
  forward=$(iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" { print $3; exit }')
  nohup dockerd >"$DOCKERD_LOG" 2>&1 &
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    kill -0 $! 2>/dev/null || fail "dockerd exited: $(tail -n 3 "$DOCKERD_LOG" | tr '\n' ' ')"
    sleep 1
  done
  docker info >/dev/null 2>&1 || fail "dockerd did not answer within 60 s (log: $DOCKERD_LOG)"
  if [ "$forward" = ACCEPT ] && [ "$(iptables -S FORWARD | awk '$1 == "-P" { print $3; exit }')" != ACCEPT ]; then
    iptables -P FORWARD ACCEPT && echo "docker_engine: iptables FORWARD policy put back to ACCEPT after dockerd" >&2
  fi
fi

if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || fail "$BASE_IMAGE is missing and debootstrap is not installed"
  [ "$(id -u)" = 0 ] || fail "$BASE_IMAGE is missing and debootstrap needs root"
  MIRROR=${DEBIAN_MIRROR:-$(debian_mirror | head -n 1)}
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
  ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/moe-dist-rootfs.XXXXXX")
  trap 'rm -rf "$ROOTFS"' EXIT
  debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
    || fail "debootstrap bookworm from $MIRROR failed: $(tail -n 3 "$ROOTFS.log" | tr '\n' ' ')"
  rm -f "$ROOTFS.log"
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  tar -C "$ROOTFS" -c . | docker import --change 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null \
    || fail "docker import of the bookworm root file system failed"
fi
echo "$BASE_IMAGE"
