# A preset's batch script (launch/slurm/presets/*.sbatch, which set PRESET and MARK and source this):
# launch/slurm/train.sbatch on the preset's converted model, RUN/init (RUN: default runs/PRESET in the
# submit directory), whose conversion is a job of its own (launch/slurm/convert.sbatch, the preset's
# first comment line). The preset's #SBATCH lines are train.sbatch's plus the preset's size; everything
# else (several nodes, a container, a lost node, preemption) is train.sbatch's. With a container, RUN
# must be the same path on the host and in the container (mount it there).
MOE_DIST_HOME=${MOE_DIST_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
RUN=${RUN:-$MOE_DIST_HOME/runs/$PRESET}
if [ ! -f "$RUN/init/$MARK" ]; then
  echo "$PRESET: $RUN/init/$MARK is missing: convert the model first, a job of its own" \
       "(launch/slurm/convert.sbatch, as in the first lines of launch/slurm/presets/$PRESET.sbatch)," \
       "and submit this one after it (sbatch --dependency=afterok:JOBID)" >&2
  exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}
export MOE_DIST_HOME
exec bash "$MOE_DIST_HOME/launch/slurm/train.sbatch" "$RUN/init/config.yaml" run.dir="$RUN" "$@"
