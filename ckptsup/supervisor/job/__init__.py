"""The job supervisor: one process per job (the batch step). The loop (loop.py) launches the node
agents, folds their frames into what it knows of the attempt (attempt, detection, liveness,
stragglers, sdc, restore_check, unhooked: observations), asks the pure `policy.decide` what to
do, and carries it out: restart in the allocation (recovery, relaunch, placement), requeue
(requeue, and watchdog for a dead batch host), shrink (shrinking), retune (interval_tuner, nccl,
preemption), place memory replicas (memory_peers), watch external checkpoints (external_*).
What a running job publishes for its operator and takes from it also lives here, because this
process writes and reads it: status.json (status), the Prometheus textfile (prom_live), the
control requests (control) and the loop's component that serves them (operating), and the
notices it sends to a command or a webhook (notify).

May import: ckptsup's base modules, checkpoint/, planning/, slurm/, the shared supervisor
modules, health/ (a failure's suspects are checked) and node/ (the rank output frame's
console printer, and in local mode the agent is its child). Never ops/.
"""
