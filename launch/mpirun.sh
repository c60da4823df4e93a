#!/usr/bin/env bash
# Train under MPI: every MPI process is one rank. Rank, world size and local rank come from the
# MPI launcher's environment (MPICH/Hydra, Open MPI, MVAPICH; see moe_dist/distributed/bootstrap.py);
# torch.distributed then meets on rank 0's host (NCCL on GPUs, gloo on CPUs).
#
#   launch/mpirun.sh -n 2 configs/test.yaml train.steps=5              # 2 ranks on this machine
#   launch/mpirun.sh -n 16 -ppn 8 -hosts node1,node2 -- configs/X.yaml KEY=VALUE ...
#       (everything before "--" goes to mpirun unchanged)
#
# mpirun: $MPIRUN, else `mpirun` next to the interpreter (the `mpich` wheel of the `mpi` extra:
# pip install -e ".[mpi]"), else on PATH. With mpi4py installed (and MASTER_ADDR unset) the ranks
# take their place and rank 0's address from mpi4py (MOE_DIST_MPI4PY=1, set here), which works over
# several nodes; without it, from the MPI variables (one node, or set MASTER_ADDR). Open MPI gets the
# needed variables with -x. PYTHON picks the interpreter (default .venv/bin/python of this checkout, or python3).
# SIGUSR1 / SIGTERM sent to this script are forwarded to mpirun (Hydra and Open MPI pass them on):
# the ranks checkpoint at the next step and stop, and the script exits with 75.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
# shellcheck source=launch/lib.sh
. "$HERE/lib.sh"

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
MPI_ARGS=()
if printf '%s\n' "$@" | grep -qx -- '--'; then  # explicit split: mpirun options -- CONFIG overrides
  while [ $# -gt 0 ] && [ "$1" != -- ]; do MPI_ARGS+=("$1"); shift; done
  shift
else
  case "${1:-}" in
    -n|-np) [ $# -ge 2 ] || usage; MPI_ARGS=(-n "$2"); shift 2 ;;
    -h|--help|"") usage ;;
  esac
fi
[ $# -ge 1 ] || usage
CONFIG=$1
shift
PY=$(moe_dist_python "$REPO") || exit 2
if [ -z "${MPIRUN:-}" ]; then
  MPIRUN=$(dirname "$PY")/mpirun
  [ -x "$MPIRUN" ] || MPIRUN=$(command -v mpirun) || {
    echo "mpirun.sh: no mpirun found; install the mpi extra (pip install -e \".[mpi]\") or set MPIRUN" >&2; exit 2; }
fi
if [ -z "${MASTER_ADDR:-}" ] && [ -z "${MOE_DIST_MPI4PY:-}" ] && "$PY" -c "import mpi4py" 2>/dev/null; then
  export MOE_DIST_MPI4PY=1  # ranks and rank 0's address from mpi4py: works over several nodes
fi
if "$MPIRUN" --version 2>/dev/null | grep -q "Open MPI"; then  # Open MPI does not pass the environment on by itself
  for v in MOE_DIST_MPI4PY MASTER_ADDR MASTER_PORT OMP_NUM_THREADS PYTHONPATH; do
    [ -n "${!v:-}" ] && MPI_ARGS+=(-x "$v")
  done
  MPI_ARGS+=(-x MOE_DIST_STATUS_DIR)  # exported by run_forwarding_signals (launch/lib.sh) before mpirun starts
  [ "$(id -u)" = 0 ] && MPI_ARGS+=(--allow-run-as-root)
fi

run_forwarding_signals self "$MPIRUN" "${MPI_ARGS[@]}" "$PY" -m moe_dist.cli "${MOE_DIST_COMMAND:-train}" \
  --config "$CONFIG" "$@"
exit "$(preemption_status "$RUN_RC" "$RUN_SIGNALLED")"
