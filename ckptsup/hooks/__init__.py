"""ckptsup.hooks: the training side (docs/training.md, docs/heartbeat.md). Imports torch, except
heartbeat.py and what it uses; `import ckptsup` does not.

session.py   attach() -> Run: resume, step_done, save, close
heartbeat.py heartbeat(step, loss): the supervisor's step protocol without checkpoints (no torch)
rank_link.py what a rank says to its agent each step (hello, step, nan, bye), shared by both
phase.py     phase("eval") / phase_heartbeat(): the rank's phase, its frames and rank 0's phase events (no torch)
settings.py  attach keywords > supervisor environment > config
state.py     what a checkpoint holds (model/optim via DCP helpers, side state as JSON tensors)
writer.py    async sharded save: staging, DCP write, hashing, cross-rank agreement, commit
reader.py    verifying DCP reader: manifest checks before any unpickling, per-item hashes
loader.py    all-or-nothing load of one checkpoint on every rank
sampler.py   ResumableDistributedSampler (global sample index; elastic resume)
agent_socket.py  rank -> agent socket; signals.py preemption flags; event_sink.py where events go
process_group.py  init_process_group with the supervisor's timeouts
testload.py  `python -m ckptsup.hooks.testload STEP_DIR` (validation level 3)
"""
