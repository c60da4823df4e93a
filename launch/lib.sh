# Shell functions shared by the launch scripts (sourced, not run).

EXIT_PREEMPTED=75  # moe_dist.train.loop.preemption.EXIT_PREEMPTED: checkpoint saved, please requeue

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
#   Sets RUN_RC (the job's exit status: CMD's, or 2 / 75 when the ranks reported them: read_reports,
#   no Python needed), RUN_SIGNALLED (the signal name, or empty) and RUN_LOST_NODES (the nodes the
#   ranks' reports name as lost, space-separated, or empty); REPORTS_READ (how many ranks reported) and
#   RUN_STATUS_DIR (where; removed now) let a caller say when none did. The reports go to a new
#   directory under $MOE_DIST_STATUS_ROOT (default $TMPDIR or /tmp), which every rank must see at the
#   same path (other nodes, a container: the Slurm batch script puts it on the shared checkout). Under
#   an outer launcher that collects reports (the Slurm batch script around torchrun.sh) they are passed
#   on to it.
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
  MOE_DIST_STATUS_DIR=$(mktemp -d "${MOE_DIST_STATUS_ROOT:-${TMPDIR:-/tmp}}/moe-dist-status.XXXXXX")
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
  read_reports "$MOE_DIST_STATUS_DIR" "$RUN_RC"
  RUN_RC=$REPORTS_RC
  if [ "$RUN_RC" != 0 ]; then  # (a run that ended well names no lost node)
    RUN_LOST_NODES=$REPORTS_LOST
  fi
  RUN_STATUS_DIR=$MOE_DIST_STATUS_DIR
  if [ -n "$outer" ] && [ -d "$outer" ]; then
    cp "$MOE_DIST_STATUS_DIR"/rank_*.json "$outer"/ 2>/dev/null
  fi
  rm -rf "$MOE_DIST_STATUS_DIR"
  MOE_DIST_STATUS_DIR=$outer
}

# read_reports DIR RC: the job's exit status from its ranks' reports in DIR (moe_dist/exits.py: one line
#   of flat JSON per rank whose "code" and "lost" fields a shell can read, so that the batch host needs
#   no project Python). Sets REPORTS_RC: 2 if a rank had bad input; 75 if every rank that reported ended
#   done or preempted and one was preempted; else RC, the launcher's own status (torchrun says 1 for any
#   failure, MPICH's mpirun ORs the ranks' codes). REPORTS_LOST: the nodes that failed ranks name as lost,
#   in rank order, each once. REPORTS_READ: how many reports were read.
read_reports() {
  local dir=$1 f code node usage=0 preempted=0 other=0
  REPORTS_RC=$2
  REPORTS_LOST=""
  REPORTS_READ=0
  while read -r f; do
    code=$(sed -n 's/^{.*"code": \(-\{0,1\}[0-9]\{1,\}\)[,}].*/\1/p' "$dir/$f" 2>/dev/null)
    [ -n "$code" ] || continue
    REPORTS_READ=$((REPORTS_READ + 1))
    case "$code" in
      0) ;;
      2) usage=1 ;;
      "$EXIT_PREEMPTED") preempted=1 ;;
      *) other=1 ;;
    esac
    [ "$code" = 1 ] || continue
    for node in $(sed -n 's/^{.*"lost": "\([^"\\]*\)".*/\1/p' "$dir/$f" 2>/dev/null); do
      [[ " $REPORTS_LOST " == *" $node "* ]] || REPORTS_LOST=${REPORTS_LOST:+$REPORTS_LOST }$node
    done
  done < <(ls "$dir" 2>/dev/null | grep -E '^rank_[0-9]+\.json$' | sort -t_ -k2,2n)
  if [ "$usage" = 1 ]; then
    REPORTS_RC=2
  elif [ "$preempted" = 1 ] && [ "$other" = 0 ]; then
    REPORTS_RC=$EXIT_PREEMPTED
  fi
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

# etcd_member HOST:PORT,...: the member of an etcd cluster this node talks to: the one on this host
#   (named as `hostname` says), else the first that accepts a TCP connection within 2 s; none: status 1.
etcd_member() {
  local ep me short
  me=$(hostname)
  short=${me%%.*}
  for ep in ${1//,/ }; do
    case "${ep%:*}" in "$me"|"$short") echo "$ep"; return 0 ;; esac
  done
  for ep in ${1//,/ }; do
    if timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "${ep%:*}" "${ep##*:}" 2>/dev/null; then
      echo "$ep"
      return 0
    fi
  done
  return 1
}

# preemption_status RC SIGNALLED: 75 if the run stopped for a signal before finishing, else RC.
preemption_status() {
  if [ "$1" = "$EXIT_PREEMPTED" ] || { [ -n "$2" ] && [ "$1" != 0 ]; }; then
    echo "$EXIT_PREEMPTED"
  else
    echo "$1"
  fi
}
