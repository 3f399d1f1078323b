"""The rank side of a node: the processes torchrun starts or becomes, which import torch.

- cold_rank: a rank started cold: installs the stack dump, then runs the script as __main__
  (script_main: shared with warm_rank);
- zygote: the node's pre-imported interpreter: it forks warm rank interpreters and torchrun;
- warm_rank: a warm rank interpreter, torch pre-imported, that becomes one rank on request;
- warm_proxy: torchrun's worker when warm interpreters are ready: it hands its rank to one and
  stands in for it (standard library only);
- torchrun_standby: a cold launch's torchrun (imports the launcher, reads its request on stdin).

The node agent (supervisor/) starts them by module name and talks to them over pipes and Unix
sockets. It never imports them. They import only the base modules (env, errors, safe_io,
stack_dump, console: a rank's ckptsup log lines) and never the supervisor (tests/test_imports.py).
"""
