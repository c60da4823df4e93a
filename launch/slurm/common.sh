# Shell functions of the Slurm batch scripts (sourced after launch/lib.sh, not run): where their srun
# steps run the tasks (the host or a container), and what a node that the ranks named lost says.

# slurm_tasks: where the tasks of the batch script's srun steps run, from the environment. Sets
#   TASK_SRUN_ARGS  srun flags: MOE_DIST_SRUN_ARGS, and pyxis's --container-* with MOE_DIST_CONTAINER_IMAGE;
#   TASK_PREFIX     words put before each task's command: MOE_DIST_TASK_PREFIX (another container runtime);
#   TASK_HOME       the checkout as the tasks see it (MOE_DIST_TASK_HOME; in a pyxis container its work
#                   directory, else MOE_DIST_HOME);
#   PY              the tasks' interpreter (PYTHON; in a pyxis container /opt/venv/bin/python, the image's).
# The ranks' reports (launch/lib.sh) go under MOE_DIST_STATUS_ROOT (default $MOE_DIST_HOME/.moe-dist-status,
# on the shared checkout, so that every node sees it), which a pyxis container gets mounted at its own path;
# give another runtime the same mount.
slurm_tasks() {
  MOE_DIST_STATUS_ROOT=${MOE_DIST_STATUS_ROOT:-$MOE_DIST_HOME/.moe-dist-status}
  export MOE_DIST_STATUS_ROOT
  mkdir -p "$MOE_DIST_STATUS_ROOT" || return 1
  # shellcheck disable=SC2206
  TASK_SRUN_ARGS=(${MOE_DIST_SRUN_ARGS:-})
  # shellcheck disable=SC2206
  TASK_PREFIX=(${MOE_DIST_TASK_PREFIX:-})
  TASK_HOME=${MOE_DIST_TASK_HOME:-$MOE_DIST_HOME}
  if [ -n "${MOE_DIST_CONTAINER_IMAGE:-}" ]; then
    local workdir=${MOE_DIST_CONTAINER_WORKDIR:-/opt/moe_dist}
    TASK_SRUN_ARGS+=(--container-image="$MOE_DIST_CONTAINER_IMAGE" --container-workdir="$workdir"
      --container-mounts="$MOE_DIST_STATUS_ROOT:$MOE_DIST_STATUS_ROOT${MOE_DIST_CONTAINER_MOUNTS:+,$MOE_DIST_CONTAINER_MOUNTS}")
    TASK_HOME=${MOE_DIST_TASK_HOME:-$workdir}
    PY=${PYTHON:-/opt/venv/bin/python}
  else
    PY=$(moe_dist_python "$MOE_DIST_HOME") || return 1
  fi
}

# node_answers NODE SINCE: whether NODE, which the ranks named lost, still answers: a one-task srun step
# on it (on the host, no container) done within MOE_DIST_PROBE_S seconds (default 15). A node that
# answers prints one line on stdout: why its ranks ended, as far as the node knows (oom_evidence since
# SINCE, epoch seconds), or that it does not know.
node_answers() {
  local node=$1 since=$2 said
  said=$(timeout -k 5 "${MOE_DIST_PROBE_S:-15}" srun --overlap --nodelist="$node" --nodes=1 --ntasks=1 \
           --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c '. "$1"; oom_evidence "$2" "$3"; echo "[answered]"' \
           _ "$MOE_DIST_HOME/launch/slurm/common.sh" "$since" "${SLURM_JOB_ID:-}" 2>/dev/null)
  [[ "$said" == *"[answered]"* ]] || return 1
  said=${said%"[answered]"*}
  said=$(echo "$said" | sed '/^$/d' | paste -sd ';' | sed 's/;/; /g')
  [ -n "$said" ] || said="nothing on this node says why (no out-of-memory kill in the kernel's log or the job's cgroup): see the ranks' lines above"
  echo "$said"
}

# oom_evidence SINCE JOBID: one line per sign, on this node, that the kernel's out-of-memory killer ended
# processes since SINCE (epoch seconds): the job's cgroup counting OOM kills (Slurm's task/cgroup: cgroup
# v2 memory.events, v1 memory.oom_control), and the kernel log's "Killed process" lines where dmesg is
# readable (the last 3).
oom_evidence() {
  local since=$1 job=$2 d n up boot line
  if [ -n "$job" ]; then
    for d in $(find /sys/fs/cgroup -maxdepth 6 -type d -name "job_$job" 2>/dev/null); do
      n=$(cat "$d/memory.events" "$d/memory.oom_control" 2>/dev/null | sed -n 's/^oom_kill \([0-9]*\)$/\1/p' | head -n 1)
      if [ -n "$n" ] && [ "$n" != 0 ]; then
        echo "out of memory: $n process(es) killed in the job's cgroup $d"
      fi
    done
  fi
  read -r up _ </proc/uptime
  boot=$(($(date +%s) - ${up%.*}))
  dmesg 2>/dev/null | while IFS= read -r line; do
    [[ "$line" =~ ^\[\ *([0-9]+)\.[0-9]+\]\ (.*Killed\ process.*)$ ]] || continue
    if [ $((boot + BASH_REMATCH[1] + 2)) -ge "$since" ]; then
      line=${BASH_REMATCH[2]}
      echo "out of memory: the kernel: ${line%% total-vm*}"
    fi
  done | tail -n 3
}

# watch_for_return NOTE NODE...: in the background, every MOE_DIST_REGROW_S seconds (default 30), until
# one of these lost nodes is idle in Slurm again (back in service, outside this job: Slurm removes a node
# that stops answering from a running job and does not give it back, launch/README.md): then writes its
# name to NOTE and sends SIGUSR1 to the batch script, whose run checkpoints and stops; the job is then
# requeued, and starts again on the nodes there are. Prints its pid.
watch_for_return() {
  local note=$1 batch=$$ n
  shift
  (
    trap - USR1 TERM
    while sleep "${MOE_DIST_REGROW_S:-30}"; do
      for n in "$@"; do
        if [ "$(sinfo -h -n "$n" -o %T 2>/dev/null)" = idle ]; then
          echo "$n" >"$note"
          kill -USR1 "$batch"
          exit 0
        fi
      done
    done
  ) >/dev/null 2>&1 &
  echo $!
}
