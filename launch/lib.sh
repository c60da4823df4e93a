# Shell functions shared by the launch scripts (sourced, not run).

EXIT_PREEMPTED=75  # moe_dist.train.preemption.EXIT_PREEMPTED: checkpoint saved, please requeue

# moe_dist_python REPO: the interpreter to use: $PYTHON, else REPO/.venv/bin/python, else python3.
moe_dist_python() {
  if [ -n "${PYTHON:-}" ]; then
    echo "$PYTHON"
  elif [ -x "$1/.venv/bin/python" ]; then
    echo "$1/.venv/bin/python"
  else
    command -v python3 || command -v python || { echo "no python found; set PYTHON" >&2; return 1; }
  fi
}

# run_forwarding_signals MODE CMD [ARGS...]
#   Runs CMD in the background and waits for it. A SIGUSR1 or SIGTERM that reaches this shell is
#   passed on as SIGUSR1 (the trainer's "checkpoint at the next step and exit"):
#     MODE=self      to CMD itself (srun and mpirun forward it to their tasks);
#     MODE=children  to CMD's child processes (torchrun's workers); CMD then starts with SIGUSR1 and
#                    SIGTERM ignored so that a signal sent to the whole process tree cannot kill the
#                    launcher before its workers have saved.
#   Sets RUN_RC (the job's exit status: CMD's, or 2 / 75 when the ranks reported them, see
#   moe_dist/exits.py; needs $PY), RUN_SIGNALLED (the signal name, or empty) and RUN_LOST_NODES (the
#   nodes the ranks' reports name as lost, space-separated, or empty). Under an outer launcher that
#   collects reports (the Slurm batch script around torchrun.sh) the ranks' reports are passed on to it.
run_forwarding_signals() {
  local mode=$1
  shift
  RUN_SIGNALLED=""
  RUN_RC=0
  RUN_LOST_NODES=""
  _RUN_PID=""
  _RUN_MODE=$mode
  local outer=${MOE_DIST_STATUS_DIR:-}
  # the ranks report their exit codes here (moe_dist/exits.py): the launcher's own status loses them
  MOE_DIST_STATUS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/moe-dist-status.XXXXXX")
  export MOE_DIST_STATUS_DIR
  trap '_forward_signal USR1' USR1
  trap '_forward_signal TERM' TERM
  if [ "$mode" = children ]; then
    ( trap '' USR1 TERM; exec "$@" ) &
  else
    "$@" &
  fi
  _RUN_PID=$!
  while :; do
    wait "$_RUN_PID"
    RUN_RC=$?
    kill -0 "$_RUN_PID" 2>/dev/null || break  # still running: wait was interrupted by a signal
  done
  trap - USR1 TERM
  if [ -n "${PY:-}" ]; then
    RUN_RC=$("$PY" -m moe_dist.exits "$MOE_DIST_STATUS_DIR" "$RUN_RC" 2>/dev/null || echo "$RUN_RC")
    if [ "$RUN_RC" != 0 ]; then  # (a run that ended well names no lost node)
      RUN_LOST_NODES=$("$PY" -m moe_dist.exits --lost-nodes "$MOE_DIST_STATUS_DIR" 2>/dev/null)
    fi
  fi
  if [ -n "$outer" ] && [ -d "$outer" ]; then
    cp "$MOE_DIST_STATUS_DIR"/rank_*.json "$outer"/ 2>/dev/null
  fi
  rm -rf "$MOE_DIST_STATUS_DIR"
  MOE_DIST_STATUS_DIR=$outer
}

_forward_signal() {
  RUN_SIGNALLED=${RUN_SIGNALLED:-SIG$1}
  echo "[launch] SIG$1 received: asking the training processes to checkpoint and stop" >&2
  # a process still starting up ignores the signal; it reads this note once it can handle one
  # (moe_dist.exits.stop_requested, STOP_REQUEST)
  echo SIGUSR1 >"$MOE_DIST_STATUS_DIR/stop_requested" 2>/dev/null
  [ -n "$_RUN_PID" ] || return 0
  if [ "$_RUN_MODE" = children ]; then
    local kids
    kids=$(pgrep -P "$_RUN_PID" 2>/dev/null || cat /proc/"$_RUN_PID"/task/*/children 2>/dev/null)
    [ -n "$kids" ] && kill -USR1 $kids 2>/dev/null
  else
    kill -USR1 "$_RUN_PID" 2>/dev/null
  fi
  return 0
}

# preemption_status RC SIGNALLED: 75 if the run stopped for a signal before finishing, else RC.
preemption_status() {
  if [ "$1" = "$EXIT_PREEMPTED" ] || { [ -n "$2" ] && [ "$1" != 0 ]; }; then
    echo "$EXIT_PREEMPTED"
  else
    echo "$1"
  fi
}
