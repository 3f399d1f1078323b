"""The supervisor side: every process of ckptsup but the ranks (no torch, never the hooks).

Rooms by process and role (docs/architecture.md §Rooms), each a sub-package whose `__init__`
says what it owns and what it may import (tests/test_imports.py holds them to it):

- `node/`   the node agent: one process per node, the ranks' parent's neighbour.
- `job/`    the job supervisor: one process per job; it decides (`policy.decide`) and carries out.
- `ops/`    the operator's commands (`ckptsup status`, `log`, `save-now`, `watchdog`, ...).
- `health/` node health checks, run on every node as their own step.

Beside them, what more than one room shares: `spec` (the launch spec the job hands each node),
`torchrun_args` (torchrun's command line), `processes` (stopping a process tree) and `cli`
(`ckptsup launch` and `ckptsup agent`, the two entry points into `job/` and `node/`).
"""
