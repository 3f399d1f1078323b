"""Node health: the checks run on every node before a launch and on a failure's suspects
(health: site commands, free space, shared-fs probe, GPUs) and the GPU checks beyond a device
count (gpu_health: XIDs, ECC, row remaps, throttling, DCGM diag). On many nodes it runs as one
`srun --overlap` step per node (`python -m ckptsup.supervisor.health.health`).

May import: ckptsup's base modules, slurm/ and the shared supervisor modules. Never job/, node/
or ops/: a check reports, the job decides.
"""
