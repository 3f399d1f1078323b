"""The node agent: one process per usable node (an srun task, or the supervisor's child in local
mode). The agent (agent.py) runs torchrun and is the node's loop; its parts: the ranks' socket
(rank_socket), the ranks as processes, their crashes and clean exits (rank_processes), their
output (rank_output), the memory tier's copies (memory_store), the zygote that forks the next
launch's torchrun and warm rank interpreters (zygote, forked, warm_pool; standby: a cold
launch's torchrun), what its ranks are doing
(evidence), hashes and test loads of external checkpoints (external_agent,
external_testload), and the cloud's preemption notices, polled on a thread (cloud_notice).

May import: ckptsup's base modules, checkpoint/, and the supervisor's shared modules (spec,
torchrun_args, processes). Never job/, ops/ or health/: the agent is told, it does not decide.
Rank processes are started by module name (ckptsup.rankside.*), never imported.
"""
