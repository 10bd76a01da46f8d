# Sourced by launch/slurm/*.sbatch: run the job step so that a stop ahead of the time limit loses no work.
#
# Slurm sends SIGUSR1 to the batch shell ahead of the walltime (#SBATCH --signal=B:USR1@SECONDS). The
# shell passes it to srun, which passes it to its tasks; every megalign rank then finishes its step,
# writes a checkpoint and exits with status 75 (megalign/trainers/stopping.py), and the job is requeued
# (#SBATCH --requeue, `scontrol requeue`) to continue with resume=auto in the same run_dir. A SIGTERM to
# the shell (scancel, preemption) is passed on the same way and stops the ranks with a checkpoint too,
# but is not requeued: whoever cancels means it, and preemption with PreemptMode=REQUEUE requeues by itself.

# _pass_on SIGNAL PID: send SIGNAL to PID when the step has started (srun passes it to every task).
_pass_on() {
  if [ -n "$2" ]; then
    kill -"$1" "$2" 2>/dev/null || true
  fi
}

# run_requeueable COMMAND...: run the job step COMMAND (an srun line) in the background, pass SIGUSR1 and
# SIGTERM to it, wait for it, requeue the job when a SIGUSR1 stopped it; returns its exit status.
run_requeueable() {
  local step_pid="" status requeue=0
  trap 'requeue=1; _pass_on USR1 "$step_pid"' USR1
  trap '_pass_on TERM "$step_pid"' TERM
  "$@" &
  step_pid=$!
  while :; do
    status=0
    wait "$step_pid" || status=$?
    kill -0 "$step_pid" 2>/dev/null || break  # a trapped signal interrupted the wait: wait on
  done
  trap - USR1 TERM
  if [ "$requeue" = 1 ] && [ "$status" -ne 0 ]; then
    echo "megalign: job $SLURM_JOB_ID stopped ahead of its time limit (status $status); requeueing it"
    scontrol requeue "$SLURM_JOB_ID" ||
      echo "megalign: job $SLURM_JOB_ID could not be requeued (sbatch --requeue, or the cluster forbids it):" \
           "resubmit it with the same run_dir to continue" >&2
  fi
  return "$status"
}
