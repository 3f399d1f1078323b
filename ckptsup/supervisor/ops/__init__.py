"""The commands that run beside a job, each in its own short process: the operator's
(`ckptsup status`, `log` (story, story_parts; restart_log for `--all`), `save-now`, `stop`,
`replace` (cli_control), `config` (the effective settings and derived timeouts)) and the job's
own helpers started as commands (`watchdog`, the step that covers the batch host; `requeue`, the
detached finisher). They talk to a running job only through its run directory (status.json,
control requests, events.jsonl) or through Slurm.

May import: ckptsup's base modules, planning/, slurm/, the shared supervisor modules, job/ (the
formats a running job publishes, the requeue and watchdog paths) and health/. Nothing imports
ops/ but the top-level `ckptsup` command, by name.
"""
