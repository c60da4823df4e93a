#!/usr/bin/env bash
# Train with torchrun: one process per GPU (or NPROC_PER_NODE processes) on this node, alone or as
# one node of a multi-node job that meets on the first node (c10d rendezvous).
#
#   launch/torchrun.sh CONFIG [KEY=VALUE ...]
#   NPROC_PER_NODE=2 launch/torchrun.sh configs/test.yaml train.steps=20          # 2 CPU processes
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node1 launch/torchrun.sh configs/tiny.yaml   # on node1, and
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node1 launch/torchrun.sh configs/tiny.yaml   # on node2
#   NNODES=1:2 MASTER_ADDR=node1 launch/torchrun.sh configs/tiny.yaml parallel.ep=auto   # elastic, on each node
#
# Environment (all optional):
#   NPROC_PER_NODE  processes on this node (default: visible GPUs, or 1 without CUDA)
#   NNODES          nodes in the job (default: SLURM_NNODES or 1); MIN:MAX: elastic (below)
#   NODE_RANK       this node's index (default: SLURM_NODEID or 0)
#   MASTER_ADDR     host of the rendezvous, the first node (default 127.0.0.1); MASTER_PORT (default 29500)
#   RDZV_ID         rendezvous id shared by the nodes (default: SLURM_JOB_ID.SLURM_RESTART_COUNT or moe-dist)
#   PYTHON          interpreter with moe_dist installed (default: .venv/bin/python of this checkout, or python3)
#   MOE_DIST_COMMAND  train (default) or eval;  TORCHRUN_ARGS  extra torchrun flags
# Elastic (NNODES=MIN:MAX): when a node is lost the other nodes' torchrun agents meet again and
# restart their ranks with the new world size (MAX_RESTARTS times, default 3), which continue from
# the last complete checkpoint (resume=auto is added; use parallel.ep=auto). A node started again
# with the same command joins: the job restarts with it, from the last complete checkpoint.
# RDZV_LAST_CALL_S (default 5): how long a meeting that has MIN nodes waits for more. The node at
# MASTER_ADDR holds the rendezvous: the job cannot outlive it, unless the rendezvous is an etcd cluster:
#   MOE_DIST_RDZV_ENDPOINTS=node0:2379,node1:2379,node2:2379   (launch/etcd.sh starts one member per node)
# torchrun's etcd-v2 backend then talks to this node's member (else the first that answers), and the
# job goes on without any one node, MASTER_ADDR's included (needs python-etcd: the `etcd` extra).
# SIGUSR1 / SIGTERM sent to this script reach the training processes as SIGUSR1: they save a
# checkpoint at the next step boundary and stop; the script then exits with 75 ("requeue me").
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
# shellcheck source=launch/lib.sh
. "$HERE/lib.sh"

if [ $# -lt 1 ] || [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
CONFIG=$1
shift
PY=$(moe_dist_python "$REPO") || exit 2

if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))') || exit 2
fi
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
ELASTIC=()
BACKEND=c10d
if [ -n "${MOE_DIST_RDZV_ENDPOINTS:-}" ]; then
  # an etcd cluster holds the rendezvous: this node's member, else the first that accepts a connection
  if ! "$PY" -c 'import etcd' 2>/dev/null; then
    echo "torchrun.sh: MOE_DIST_RDZV_ENDPOINTS needs python-etcd in $PY (pip install -e '.[etcd]')" >&2
    exit 2
  fi
  BACKEND=etcd-v2
  MOE_DIST_RENDEZVOUS=$(etcd_member "$MOE_DIST_RDZV_ENDPOINTS") || {
    echo "torchrun.sh: no etcd member of MOE_DIST_RDZV_ENDPOINTS=$MOE_DIST_RDZV_ENDPOINTS accepts a connection" >&2
    exit 1
  }
  export MOE_DIST_RENDEZVOUS
fi
if [[ "$NNODES" == *:* ]]; then
  # elastic: MIN:MAX nodes; when a node is lost the others meet again and restart their workers
  # with the new world size, which continue from the last complete checkpoint
  if [ "$BACKEND" = c10d ]; then
    : "${MASTER_ADDR:?set MASTER_ADDR to the node that holds the rendezvous (or MOE_DIST_RDZV_ENDPOINTS)}"
    export MOE_DIST_RENDEZVOUS="$MASTER_ADDR:${MASTER_PORT:-29500}"
  fi
  RDZV=(--nnodes="$NNODES" --rdzv-backend="$BACKEND" --rdzv-endpoint="$MOE_DIST_RENDEZVOUS"
        --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-moe-dist}.${SLURM_RESTART_COUNT:-0}}"
        --max-restarts="${MAX_RESTARTS:-3}" --rdzv-conf="last_call_timeout=${RDZV_LAST_CALL_S:-5}")
  ELASTIC=(resume=auto)
  # torchrun's agents share one TCP store across rendezvous rounds by default, and a rank-0 agent of a
  # later round does not publish its address there again: a node that joins a running job waits for it
  # until the rendezvous times out. Without the sharing each round publishes its own (the workers'
  # store then lives in rank 0's process, as under srun)
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
elif [ "$NNODES" -gt 1 ]; then
  # the rendezvous every node reached: the workers find their interface by the route to it
  # (moe_dist/distributed/interfaces.py); torchrun gives them another MASTER_ADDR, the first rank's host name
  if [ "$BACKEND" = c10d ]; then
    : "${MASTER_ADDR:?set MASTER_ADDR to the first node of the job}"
    export MOE_DIST_RENDEZVOUS="$MASTER_ADDR:${MASTER_PORT:-29500}"
  fi
  RDZV=(--nnodes="$NNODES" --node-rank="$NODE_RANK" --rdzv-backend="$BACKEND"
        --rdzv-endpoint="$MOE_DIST_RENDEZVOUS"
        --rdzv-id="${RDZV_ID:-${SLURM_JOB_ID:-moe-dist}.${SLURM_RESTART_COUNT:-0}}")
else
  RDZV=(--standalone --nnodes=1)
fi
# torchrun must not turn SIGTERM into "kill the workers in 30 s": they handle it themselves
export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGINT,SIGHUP,SIGQUIT}
# torchrun's own default with several processes per node, set here so that it does not print a banner about it
if [ "$NPROC_PER_NODE" != 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

# torchrun, whose failure report is the job's own (the ranks' one line or traceback; moe_dist/torchrun_launch.py)
# shellcheck disable=SC2086
run_forwarding_signals children "$PY" -m moe_dist.torchrun_launch "${RDZV[@]}" --nproc-per-node="$NPROC_PER_NODE" \
  ${TORCHRUN_ARGS:-} --module moe_dist.cli "${MOE_DIST_COMMAND:-train}" --config "$CONFIG" "${ELASTIC[@]}" "$@"
exit "$(preemption_status "$RUN_RC" "$RUN_SIGNALLED")"
