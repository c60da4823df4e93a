#!/usr/bin/env bash
# One member of a job's etcd cluster, on this node: the rendezvous of launch/torchrun.sh that outlives any
# one node (MOE_DIST_RDZV_ENDPOINTS, torchrun's etcd-v2 backend). Three members on three nodes keep
# working when any one of them is lost. Runs in the foreground until stopped (SIGTERM/SIGINT), then
# removes its data.
#
#   launch/etcd.sh node0,node1,node2 [TOKEN]      # on each of node0, node1 and node2
#   MOE_DIST_RDZV_ENDPOINTS=node0:2379,node1:2379,node2:2379 NNODES=2:3 launch/torchrun.sh CONFIG ...
#
# Needs Debian's etcd-server (`apt-get install etcd-server`, etcd 3.4: the v2 API torchrun's backend
# speaks is turned on here) and, for torchrun, PyPI's python-etcd (the `etcd` extra).
# TOKEN (default moe-dist): one per cluster, e.g. the job id. Environment: MOE_DIST_ETCD_PORT (clients,
# default 2379; members talk on the next port), MOE_DIST_ETCD_DIR (data, default
# ${TMPDIR:-/tmp}/moe-dist-etcd-TOKEN-HOST), ETCD (the program, default etcd).
set -uo pipefail
if [ $# -lt 1 ] || [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
MEMBERS=$1
TOKEN=${2:-moe-dist}
ME=$(hostname)
PORT=${MOE_DIST_ETCD_PORT:-2379}
PEER=$((PORT + 1))
ETCD=${ETCD:-etcd}
if ! command -v "$ETCD" >/dev/null; then
  echo "etcd.sh: $ETCD not found: install Debian's etcd-server (apt-get install etcd-server) or set ETCD" >&2
  exit 2
fi
if [[ ",$MEMBERS," != *",$ME,"* ]]; then
  echo "etcd.sh: this node ($ME) is not one of the members $MEMBERS" >&2
  exit 2
fi
CLUSTER=""
for m in ${MEMBERS//,/ }; do
  CLUSTER+="${CLUSTER:+,}$m=http://$m:$PEER"
done
DIR=${MOE_DIST_ETCD_DIR:-${TMPDIR:-/tmp}/moe-dist-etcd-$TOKEN-$ME}
"$ETCD" --name "$ME" --data-dir "$DIR" --enable-v2=true \
  --listen-client-urls "http://0.0.0.0:$PORT" --advertise-client-urls "http://$ME:$PORT" \
  --listen-peer-urls "http://0.0.0.0:$PEER" --initial-advertise-peer-urls "http://$ME:$PEER" \
  --initial-cluster "$CLUSTER" --initial-cluster-token "$TOKEN" --initial-cluster-state new &
PID=$!
trap 'kill -TERM "$PID" 2>/dev/null' TERM INT
while :; do
  wait "$PID"
  RC=$?
  kill -0 "$PID" 2>/dev/null || break  # still running: the wait was interrupted by a signal
done
rm -rf "$DIR"
exit "$RC"
