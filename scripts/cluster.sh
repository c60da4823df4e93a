#!/usr/bin/env bash
# Nodes as network namespaces on this machine (root): each with its own interface eth0, address
# (10.213.27.I+1, reachable only from the other nodes), host name nodeI and a hosts file naming
# every node. Runs tests/helpers/cluster/ (see its docstring and docs/namespace-cluster.md).
#   sudo scripts/cluster.sh up 2 [--rate 500mbit]      # node0, node1 on the bridge mdn-br
#   sudo scripts/cluster.sh exec node1 -- CMD ...       # CMD on node1 (its network and host name)
#   sudo scripts/cluster.sh status
#   sudo scripts/cluster.sh down [--all]               # --all: also leftovers of crashed runs (mdn*)
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=launch/lib.sh
. "$REPO/launch/lib.sh"
PY=$(moe_dist_python "$REPO") || exit 2
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m tests.helpers.cluster "$@"
