"""attach() → Run: the whole training-side integration (docs/training.md).

    run = ckptsup.attach(model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader)
    step = run.resume()            # next step to run; 0 when nothing usable exists
    while step < total:
        loss = train_step(...)
        run.step_done(step, loss=loss)
        step += 1
    run.close()

A checkpoint named step_<N> holds the state after N completed steps, so resume() returns N.
Step-based saves need no agreement (every rank computes the same). What ranks learn at different
times (a time-based save, save_now, a stop step, a preemption signal, a new interval) is agreed in
one small all-reduce on a gloo group of the session's own, about once a second (every step costs
~2 ms on a loaded 2-core box; see bench/bench_step_overhead.py), at steps all ranks know in
advance; a stop_at therefore lands at most ~1 s of steps after the step asked for. A NaN is this
rank's alone: it reports and exits, and its peers' next collective fails. Saves use another gloo
group on the background thread (writer.py).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

from ..checkpoint.commit import WriterLock, parse_step
from ..checkpoint.validate import quarantine
from ..checkpoint.trust import CheckpointDirUntrusted
from ..config import AUTO
from ..env import LOCAL_RANK, LOCAL_WORLD_SIZE, ExitStatus, RankEnv
from ..errors import CheckpointError, CkptsupError, ConfigError
from ..events import Event
from .compute_time import CommTimer
from .process_group import new_gloo_group
from .event_sink import Reporter
from .settings import Settings, resolve_settings
from .. import messages
from ..wire import Phase
from ..memory_left import memory_left
from .memory_tier import (MemoryClient, MemorySaveResult, MemorySaver, fit_budget,
                          memory_checkpoint_id, newest_common)
from .resume_sources import Candidate, Source, candidates as resume_candidates, fetch, files_by_source, object_tier
from .rank_link import (Hooks, NonFiniteLossError, ReplicasDisagreeError, StepLink, claim_hooks, exit_rank,
                        loss_value)
from . import fingerprint
from .signals import StopFlag, emergency_save_fits
from .state import TrainingState, check_dataloader, isolate_loader_rng
from .writer import CheckpointWriter, SaveResult, WriterConfig

log = logging.getLogger("ckptsup.hooks")

PROGRESS_EVERY_S = 30.0
CONTROL_INTERVAL_S = 1.0   # how often the ranks agree on saves/stops (one tiny gloo all-reduce)
MAX_SYNC_EVERY = 1000
NO_STOP = 1 << 62


class SaveTimer:
    """When the next time-based save is due: `interval_s` after the last save (or resume) plus a
    delay drawn in [0, jitter_s] per period, so jobs started together do not all write to the
    shared file system in the same second.

    The draw comes from the job's seed (job id and attempt) and the step, never from each rank's
    own stream: the ranks save when the first of them is due (a max-reduce), and independent
    per-rank draws would shrink a large job's jitter to about jitter_s / world_size. A private
    Random per draw also leaves the global stream, which user code may depend on, untouched.
    """

    def __init__(self, *, jitter_s: float, seed: str, now: float, step: int) -> None:
        self.jitter_s = jitter_s
        self.seed = seed
        self.restart(now, step=step)

    def restart(self, now: float, *, step: int) -> None:
        """A new period from `now`; every rank passes the same step, so draws the same delay."""
        self.start = now
        self.delay_s = random.Random(f"{self.seed}:{step}").uniform(0.0, self.jitter_s)

    def due_at(self, interval_s: float) -> float:
        """The interval is read at each check, so a set_interval applies to the running period."""
        return self.start + interval_s + self.delay_s

    def due(self, now: float, interval_s: float) -> bool:
        return interval_s > 0 and now >= self.due_at(interval_s)


def attach(*, model: Any, optimizer: Any = None, lr_scheduler: Any = None, dataloader: Any = None,
           extra: dict[str, Any] | None = None, checkpoint_dir: str | None = None,
           save_every_steps: int | None = None, save_every_s: float | None = None,
           replicas: bool | None = None, **overrides: Any) -> "Run":
    """Attach ckptsup to a training loop. Keyword overrides win over the supervisor's environment,
    which wins over the config files; any other [checkpoint] key may be passed too. `replicas`:
    whether every rank holds the same model bytes (docs/sdc.md); None: a DistributedDataParallel
    model does, anything else is not compared."""
    if replicas is not None and not isinstance(replicas, bool):
        raise ConfigError(f"attach(replicas={replicas!r}): expected True, False or None (docs/sdc.md)")
    claim_hooks(Hooks.FULL)
    env = RankEnv.from_environ()
    settings = resolve_settings(env=env, checkpoint_dir=checkpoint_dir, save_every_steps=save_every_steps,
                                save_every_s=save_every_s, overrides=overrides)
    check_dataloader(dataloader, allow_stateless=settings.allow_stateless_dataloader)
    isolate_loader_rng(dataloader)
    return Run(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=dataloader,
               extra=dict(extra or {}), settings=settings, env=env, replicas=replicas)


class Run:
    def __init__(self, *, model: Any, optimizer: Any, lr_scheduler: Any, dataloader: Any,
                 extra: dict[str, Any], settings: Settings, env: Any, replicas: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import torch.distributed as dist

        self.settings = settings
        self.env = env
        self.clock = clock
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.state = TrainingState(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                   dataloader=dataloader, extra=extra, rank=self.rank, world_size=self.world_size)
        self.link = StepLink(env=env, rank=self.rank, world_size=self.world_size, checkpoints=True,
                             schedule={"save_every_steps": settings.save_every_steps,
                                       "save_every_s": settings.save_every_s})
        self.channel = self.link.channel
        self.reporter = Reporter(env=env, rank=self.rank, channel=self.channel)
        self.link.phases.emit = self.reporter.emit   # rank 0's phase changes: the restart log's time per phase
        self.link.phases.enter(Phase.INIT, 0)
        multi = self.distributed and self.world_size > 1
        self.control_pg = new_gloo_group(settings.save_timeout_s) if multi else None
        self.comm = CommTimer()   # compute time = step time - time blocked in collectives (stragglers)
        if multi:
            self.comm.attach(model)
        save_pg = new_gloo_group(settings.save_timeout_s) if multi else None
        self.lock = WriterLock(settings.checkpoint_dir, epoch=env.epoch, job_id=env.job_id) if self.rank == 0 else None
        if self.lock is not None:
            from ..checkpoint.trust import private_mkdir

            private_mkdir(settings.checkpoint_dir)
            self.lock.acquire()
        self.writer = CheckpointWriter(
            WriterConfig(checkpoint_dir=settings.checkpoint_dir, rank=self.rank, world_size=self.world_size,
                         job_id=env.job_id, attempt=env.attempt, epoch=env.epoch, run_dir=env.run_dir,
                         algorithm=settings.hash_algorithm, mesh={"dp": self.world_size},
                         node_local_dir=settings.node_local_dir, local_rank=int(os.environ.get(LOCAL_RANK, "0")),
                         keep_local=settings.config.checkpoint.keep_last if settings.config is not None else 3),
            process_group=save_pg, on_result=self._on_save_result, clock=clock)
        # rank 0 looks after committed checkpoints: promotion to slower tiers, retention, level-3 test loads
        self.keeper = self._housekeeper() if self.rank == 0 else None
        self.stop = StopFlag()
        self.stop.install()
        self.next_step = 0          # steps completed = the N of the next checkpoint
        self.last_saved_step: int | None = None
        self.save_timer = SaveTimer(jitter_s=settings.jitter_s, seed=f"{env.job_id}:{env.attempt}",
                                    now=clock(), step=0)
        self.agreed_stop: int | None = None
        self.next_sync = 0
        self.step_time_ema: float | None = None
        self.preempted = False
        self.last_progress = clock()
        self.closed = False
        self.load_tiers: dict[str, int] = {}   # files the last resume read from each tier, all ranks together
        self.memory, self.memory_every = self._memory_saver()
        self.replicas = self._replica_check(model, optimizer, replicas)

    def _replica_check(self, model: Any, optimizer: Any, replicas: bool | None) -> fingerprint.ReplicaCheck | None:
        """[sdc]: DDP replicas compare fingerprints, and HSDP's ranks that hold the same shard
        (docs/sdc.md); shards have nothing to compare, and a plain module is compared only when
        the script says every rank holds the same bytes. The ranks agree on it (`_all_gather` of
        each rank's replica key): when some compare and others hold no replica (HSDP on some
        pipeline stages, plain shards on others), the others take part with nothing to compare,
        since the check is a collective every rank must enter."""
        config = self.settings.config
        if config is None or not config.sdc.enabled or self.control_pg is None:
            return None   # the same on every rank: no exchange needed
        kind = fingerprint.Replication.UNKNOWN
        group: tuple[int, ...] = ()
        if model is not None and replicas is not False:
            kind = fingerprint.replication(model)
            if kind in (fingerprint.Replication.HYBRID, fingerprint.Replication.REPLICAS):
                group = fingerprint.replica_group(model, self.rank)   # DDP: its (sub)group; HSDP: the same shard's
            if kind is fingerprint.Replication.HYBRID and len(group) < 2:
                kind = fingerprint.Replication.SHARDS   # on the mesh's replicated dimension alone: nothing to compare
        compares = kind in (fingerprint.Replication.REPLICAS, fingerprint.Replication.HYBRID) or (
            kind is fingerprint.Replication.UNKNOWN and bool(replicas))
        keys: list[int] = self._all_gather((min(group) if group else 0) if compares else fingerprint.NO_REPLICA)
        comparing = [r for r, k in enumerate(keys) if k != fingerprint.NO_REPLICA]
        if not comparing:
            if self.rank == 0:
                log.warning("ckptsup: no replica fingerprints: %s (docs/sdc.md)",
                            "the parameters are shards (FSDP / tensor parallel), so no two ranks hold the same bytes"
                            if kind is fingerprint.Replication.SHARDS else
                            "the model is not DistributedDataParallel, so nothing says every rank holds the same "
                            "bytes; pass attach(replicas=True) if it does")
            return None
        if self.rank == 0:
            if len(comparing) < len(keys):
                log.warning("ckptsup: replica fingerprints on ranks %s only; the other %d ranks hold no replica "
                            "and take part with nothing to compare (docs/sdc.md)",
                            ",".join(map(str, comparing)), len(keys) - len(comparing))
            elif kind is fingerprint.Replication.HYBRID:
                log.warning("ckptsup: replica fingerprints: HSDP, each shard compared across its %d replicas "
                            "(docs/sdc.md)", len(group))
        return fingerprint.ReplicaCheck(model=model, optimizer=optimizer, rank=self.rank, world_size=self.world_size,
                                        group=self.control_pg, every_steps=config.sdc.every_steps,
                                        key=keys[self.rank])

    def _memory_saver(self) -> tuple[MemorySaver | None, int]:
        """The memory tier (memory_tier.py): on when [memory] enabled and an agent holds the bundles."""
        config = self.settings.config
        if config is None or not config.memory.enabled or not self.env.memory_socket:
            return None, 0
        client = MemoryClient(socket_path=self.env.memory_socket, secret_file=self.env.secret_file, rank=self.rank)
        every = self.env.memory_every_steps or config.memory.every_steps   # the supervisor's (adaptive) schedule first
        limit = config.memory.max_bytes
        saver = MemorySaver(client, algorithm=self.settings.hash_algorithm,
                            max_bytes=self._memory_fit if limit == AUTO else limit,
                            on_result=self._on_memory_result, clock=self.clock)
        return saver, every

    def _memory_fit(self) -> tuple[int, str]:
        """[memory] max_bytes = auto, asked at the first memory save (memory_tier.fit_budget)."""
        config = self.settings.config.memory
        text = os.environ.get(LOCAL_WORLD_SIZE, "")   # the ranks sharing this node's agent
        local_ranks = int(text) if text.isdigit() and int(text) >= 1 else 1
        # a restart's ranks find their agent still holding the last attempt's bundles: not the job's memory
        assert self.memory is not None
        # in a container the cgroup's limit, not the host's MemAvailable, is what is left (memory_left.py)
        left = memory_left()
        free = left.bytes + self.memory.client.stored_bytes()
        limit = fit_budget(free, keep=config.keep, local_ranks=local_ranks, replicas=config.replicas)
        where = (f"the node's {free / 2**30:.1f} GiB available" if not left.limit else
                 f"the {free / 2**30:.1f} GiB the container's {left.limit / 2**30:.1f} GiB limit ({left.source}) leaves; "
                 "raise the container's memory limit for more")
        return max(limit, 1), (f"what fits (max_bytes = auto: half of {where} over "
                               f"{config.keep + 1} copies x {local_ranks} rank(s) x {1 + config.replicas} node(s) = "
                               f"{limit} bytes)")

    def _housekeeper(self) -> Any:
        from ..checkpoint.housekeeping import Housekeeper

        return Housekeeper.from_config(self.settings.config, checkpoint_dir=self.settings.checkpoint_dir,
                                       node=self.env.node, job_id=self.env.job_id,
                                       emit=lambda event, fields: self.reporter.emit(event, **fields))

    # ---- resume -------------------------------------------------------------------------------
    def resume(self, *, candidates: list[str] | None = None, memory_step: int | None = None) -> int:
        """Load the newest usable checkpoint (the supervisor's CKPTSUP_RESUME_FROM first); on a
        corrupt one, quarantine it and fall back: to its object-store copy when there is one
        (resume_sources.py), else to the previous checkpoint. Returns the next step.
        `candidates` (rank 0's list counts): try only these, newest first — a framework that has
        already positioned its data for one checkpoint (integrations/hf.py) pins it, so neither
        the memory tier nor the object store is asked; `memory_step` pins the memory checkpoint of
        that step instead (the framework positioned its data for it)."""
        from .loader import Loaded, is_corruption, is_untrusted, load_checkpoint

        self.link.phases.enter(Phase.LOAD, 0)
        start = self.clock()
        pinned = candidates is not None
        tier = self._object_tier() if self.rank == 0 and not pinned else None
        mine = None
        if self.rank == 0:
            mine = (self._candidates(tier) if not pinned else
                    [Candidate(str(p), Source.SHARED, parse_step(Path(p).name)) for p in candidates or []])
        found, pinned = self._broadcast((mine, pinned))
        if (not pinned or memory_step is not None) and self._resume_from_memory(found, start, only=memory_step):
            return self.next_step
        untrusted: list[str] = []
        for candidate in found:
            path = candidate.path
            if candidate.source is Source.OBJECT:
                why_not = self._broadcast(fetch(tier, candidate, self.settings.checkpoint_dir) if self.rank == 0 else None)
                if why_not is not None:
                    log.error("ckptsup: %s", why_not)
                    continue
            error = load_checkpoint(self, Path(path))
            if isinstance(error, Loaded):   # else the error, the same on every rank
                self.next_step = self.last_saved_step = error.step
                self.save_timer.restart(self.clock(), step=self.next_step)
                self.load_tiers = self._sum_over_ranks(error.tiers)
                tiers: dict[str, Any] = dict(self.load_tiers)   # event fields (Reporter.emit's **fields)
                self.reporter.emit(Event.CHECKPOINT_LOADED, step=self.next_step, path=str(path),
                                   load_s=round(self.clock() - start, 3), source=str(candidate.source),
                                   files_by_source=files_by_source(self.load_tiers, candidate.source), **tiers)
                self.link.phases.enter(Phase.TRAIN, self.next_step)
                return self.next_step
            log.error("ckptsup: cannot resume from %s: %s", path, error)
            if is_untrusted(error):
                untrusted.append(str(path))   # skipped, not quarantined: its content may be fine
                continue
            if not is_corruption(error):
                raise error
            if self.rank == 0:
                self._reject(Path(path), error)
        if untrusted:
            # starting over would throw their progress away: a human decides (exit 2, no requeue)
            raise CheckpointDirUntrusted(f"no checkpoint to resume from but {len(untrusted)} untrusted one(s), newest "
                                         f"{untrusted[0]}; fix their owner/mode (see the log above) or move them aside")
        self.link.phases.enter(Phase.TRAIN, 0)
        return 0

    def _resume_from_memory(self, candidates: list[Candidate], start: float, *, only: int | None = None) -> bool:
        """The newest memory checkpoint every rank's agent holds, when no disk checkpoint is newer
        (memory_tier.py); all or nothing, else the disk candidates decide."""
        from .loader import Loaded, load_memory

        if self.memory is None:
            return False
        try:
            held = self.memory.client.held()
        except (CkptsupError, OSError) as err:
            log.warning("ckptsup: rank %d cannot ask its agent for memory checkpoints: %s", self.rank, err)
            held = []
        gathered = self._all_gather(held)
        pick = newest_common(gathered)
        steps = [c.step if c.step is not None else parse_step(Path(c.path).name) for c in candidates]
        newest_disk = max((s for s in steps if s is not None), default=-1)
        if pick is None or pick[0] < newest_disk or (only is not None and pick[0] != only):
            # said on a resume (a disk checkpoint, or some memory copy, exists), not on a fresh start
            if self.rank == 0 and (any(gathered) or candidates):
                log.warning("ckptsup: no memory checkpoint every rank's agent holds is newer than the disk's step %d "
                            "(a node and its buddy lost together, or no memory save yet): resuming from disk", newest_disk)
            return False
        loaded = load_memory(self, pick[0])
        if not isinstance(loaded, Loaded):
            log.warning("ckptsup: rank %d: memory checkpoint of step %d not used (%s); resuming from disk",
                        self.rank, pick[0], loaded)
            return False
        self.next_step = loaded.step
        # the disk tiers hold this step only when a committed disk checkpoint of it was found (a
        # failure right after that save): saving it again would be refused as another checkpoint
        self.last_saved_step = loaded.step if newest_disk == loaded.step else None
        self.save_timer.restart(self.clock(), step=self.next_step)
        self.load_tiers = self._sum_over_ranks(loaded.tiers)
        self.reporter.emit(Event.CHECKPOINT_LOADED, step=self.next_step, path=f"memory:step_{self.next_step}",
                           load_s=round(self.clock() - start, 3),
                           source="peer_memory" if self.load_tiers["peer_memory_files"] else "memory",
                           files_by_source={**files_by_source({}, Source.SHARED), "memory": self.load_tiers["memory_files"],
                                            "peer_memory": self.load_tiers["peer_memory_files"]},
                           read_local_files=0, read_shared_files=0, local_fallback_files=0)
        self.link.phases.enter(Phase.TRAIN, self.next_step)
        return True

    def _all_gather(self, value: Any) -> list[Any]:
        if self.control_pg is None:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.control_pg)
        return out

    def _object_tier(self) -> Any:
        try:
            return object_tier(self.settings.config, checkpoint_dir=self.settings.checkpoint_dir,
                               node=self.env.node, job_id=self.env.job_id)
        except (CkptsupError, OSError) as err:   # a bad store must not cost the shared checkpoints
            log.warning("ckptsup: object store not used for this resume: %s", err)
            return None

    def _candidates(self, tier: Any = None) -> list[Candidate]:
        return resume_candidates(self.settings.checkpoint_dir, resume_from=self.env.resume_from or "", tier=tier)

    def _reject(self, path: Path, error: Exception) -> None:
        step = parse_step(path.name)
        if path.is_dir():
            try:
                dest = quarantine(path, str(error))
                log.error("ckptsup: quarantined %s as %s", path, dest)
            except (CheckpointError, OSError) as err:
                log.error("ckptsup: could not quarantine %s: %s", path, err)
        self.reporter.emit(Event.CHECKPOINT_REJECTED, step=step, level=2, reason=str(error)[:300])

    # ---- collectives on the control group -----------------------------------------------------
    def _broadcast(self, value: Any) -> Any:
        if self.control_pg is None:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control_pg)
        return box[0]

    def _sum_over_ranks(self, counts: dict[str, int]) -> dict[str, int]:
        """Every rank's counts added up (each rank fills its own slots of a max-reduce)."""
        keys = sorted(counts)
        if self.control_pg is None:
            return {k: counts[k] for k in keys}
        slots = [0] * (len(keys) * self.world_size)
        for i, key in enumerate(keys):
            slots[i * self.world_size + self.rank] = counts[key]
        reduced = self.reduce_max(slots)
        return {key: sum(reduced[i * self.world_size:(i + 1) * self.world_size]) for i, key in enumerate(keys)}

    def all_ok(self, ok: bool) -> bool:
        return self.reduce_max([0 if ok else 1])[0] == 0

    def reduce_max(self, values: list[int]) -> list[int]:
        if self.control_pg is None:
            return values
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.int64)
        t0 = time.perf_counter()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control_pg)
        self.comm.add(time.perf_counter() - t0)   # waiting here for a slow rank is not compute
        return tensor.tolist()

    # ---- the step boundary --------------------------------------------------------------------
    def step_done(self, step: int, *, loss: Any = None) -> None:
        """Call once per completed optimizer step (step = its 0-based index)."""
        now = self.clock()
        self.next_step = step + 1
        step_time = self.link.tick(now)
        blocked = self.comm.take_blocked()
        compute = None if step_time is None or blocked is None else max(0.0, step_time - blocked)
        value = loss_value(loss)   # one host read: the NaN check and rank 0's report share it
        if value is not None and not math.isfinite(value):
            self._nan(step, loss)
        if step_time is not None:
            self.step_time_ema = step_time if self.step_time_ema is None else 0.9 * self.step_time_ema + 0.1 * step_time
        every = self.settings.save_every_steps
        save = every > 0 and (step + 1) % every == 0  # the same decision on every rank, no collective
        if step >= self.next_sync:
            save = self._sync(step, now) or save
        stop = self.agreed_stop is not None and step >= self.agreed_stop
        sdc_s = self.replicas.seconds if self.replicas is not None and self.rank == 0 else None
        if self.link.step(step, step_time, compute_s=compute, loss=value if self.rank == 0 else None, sdc_s=sdc_s):
            self.reporter.emit(Event.FIRST_STEP, step=step)
        if self.rank == 0 and step_time is not None and now - self.last_progress >= PROGRESS_EVERY_S:
            self.last_progress = now
            cost: dict[str, Any] = {} if sdc_s is None else {"sdc_s": round(sdc_s, 6)}
            self.reporter.emit(Event.STEP_PROGRESS, step=step, step_time_s=round(step_time, 6), **cost)
        memory_due = self.memory is not None and (step + 1) % self.memory_every == 0
        if self.replicas is not None and not save and not stop and (memory_due or self.replicas.due(step)):
            self._check_replicas(step)   # a save checks for itself (save())
        if stop:
            self._stop(step)
        if save:
            self.save(reason="interval")
        if memory_due:
            self._memory_save()

    def _sync(self, step: int, now: float) -> bool:
        """The ranks agree, in one small all-reduce, on what they may have learnt at different
        times: a time-based save or save_now, a stop step, a preemption signal, an interval
        change, and when to sync next (about every CONTROL_INTERVAL_S). Returns: save now."""
        s = self.settings
        time_due = self.save_timer.due(now, s.save_every_s)
        save_flag = 1 if (self.channel.commands.take_save_now() or time_due) else 0
        every = 1
        if self.step_time_ema and self.control_pg is not None:  # alone, a rank decides every step for free
            every = max(1, min(MAX_SYNC_EVERY, int(CONTROL_INTERVAL_S / self.step_time_ema)))
        has_interval = 1 if self.channel.commands.interval is not None else 0
        save_any, neg_stop, signal_any, every, neg_has = self.reduce_max(
            [save_flag, -self._stop_proposal(step), 1 if self.stop.set else 0, every, -has_interval])
        self.next_sync = step + every
        self.preempted = self.preempted or bool(signal_any)  # a signal on any rank is a preemption for all
        if -neg_stop != NO_STOP:
            self.agreed_stop = min(self.agreed_stop or NO_STOP, -neg_stop)
        if neg_has == -1:  # every rank has the new interval: apply it at the same step everywhere
            self._apply_interval()
        return bool(save_any)

    def _stop_proposal(self, step: int) -> int:
        if self.stop.set:
            return step
        requested = self.link.requested_stop(step)
        return NO_STOP if requested is None else requested

    def _apply_interval(self) -> None:
        change = self.channel.commands.take_interval()
        if change is None:
            return
        if change.interval_s is not None:
            self.settings.save_every_s = float(change.interval_s)
        if change.save_every_steps is not None:
            self.settings.save_every_steps = change.save_every_steps
        every = change.memory_every_steps   # the adaptive memory schedule: the same step on every rank
        if self.memory is not None and every is not None and every >= 1:
            self.memory_every = every

    def _nan(self, step: int, loss: Any) -> None:
        """Only this rank knows; its exit (or error) ends the others' next collective."""
        self.writer.wait()
        message = self.link.report_nan(step, loss)
        if self.channel.connected:
            self._exit(ExitStatus.RANK_NAN, message)
        self._shutdown(status=int(ExitStatus.RANK_NAN))
        raise NonFiniteLossError(message + "; no checkpoint of this state was written")

    def _check_replicas(self, step: int) -> fingerprint.Verdict | None:
        """Compare fingerprints (collective); on a disagreement report and exit (docs/sdc.md)."""
        if self.replicas is None:
            return None
        verdict = self.replicas.check(self.next_step)
        if not verdict.agree:
            self._sdc(step, verdict)
        return verdict

    def _sdc(self, step: int, verdict: fingerprint.Verdict) -> None:
        """Every rank knows the verdict: each reports it (the supervisor takes the first) and exits;
        no checkpoint of this state is ever resumed from."""
        self.writer.wait()
        agreed = self.replicas.agreed if self.replicas is not None else None
        message = self.link.report_sdc(step, verdict, agreed_step=None if agreed is None else agreed - 1)
        if self.channel.connected:
            self._exit(ExitStatus.FAILURE, message)
        self._shutdown(status=int(ExitStatus.FAILURE))
        raise ReplicasDisagreeError(message + "; checkpoints of this state are never resumed from")

    # ---- saving -------------------------------------------------------------------------------
    def save(self, *, reason: str = "explicit", blocking: bool | None = None) -> SaveResult | None:
        """Checkpoint the state after `next_step` completed steps. Collective: every rank calls it
        at the same step (step_done does). Async unless blocking or async_save is off."""
        if self.last_saved_step == self.next_step:
            return self.writer.last
        blocking = (not self.settings.async_save) if blocking is None else blocking
        step = self.next_step
        self.last_saved_step = step
        self.save_timer.restart(self.clock(), step=step)
        meta: dict[str, Any] = {"reason": reason}
        verdict = self.replicas.check(step) if self.replicas is not None else None
        if verdict is not None:
            meta["replicas"] = fingerprint.record(verdict)   # checkpoint/validate.py refuses agree=false
            blocking = blocking or not verdict.agree         # written as evidence, then the rank reports
        if blocking:
            self.link.phases.enter(Phase.SAVE, step)
        result = self.writer.save(step=step, device_state=self.state.model_optim_state(),
                                  side_state=self.state.side_state(step=step, meta={"reason": reason}),
                                  blocking=blocking, extra_meta=meta)
        if blocking:
            self.link.phases.enter(Phase.TRAIN, step)
        if verdict is not None and not verdict.agree:
            self._sdc(step - 1, verdict)
        return result

    def _memory_save(self) -> None:
        """A memory save of the state after `next_step` steps; skipped while the previous one is in flight."""
        step = self.next_step
        if self.replicas is not None and not self.replicas.check(step).agree:
            self._sdc(step - 1, self.replicas.check(step))
        cid = memory_checkpoint_id(job_id=self.env.job_id, attempt=self.env.attempt, epoch=self.env.epoch, step=step)
        assert self.memory is not None
        self.memory.save(step=step, checkpoint_id=cid, device_state=self.state.model_optim_state(),
                         side_state=self.state.side_state(step=step, meta={"reason": "memory"}, with_globals=True),
                         extra={"rank": self.rank, "world_size": self.world_size})

    def _on_memory_result(self, result: MemorySaveResult) -> None:
        if not result.ok:
            log.warning("ckptsup: rank %d: memory save of step %d failed: %s (the disk checkpoints are unaffected)",
                        self.rank, result.step, result.reason)
        why: dict[str, Any] = {"reason": result.reason[:300]} if not result.ok else {}
        self.reporter.emit(Event.MEMORY_SAVED, step=result.step, ok=result.ok, stall_s=round(result.stall_s, 6),
                           write_s=round(result.write_s, 6), bytes=result.bytes, **why)

    def _on_save_result(self, result: SaveResult) -> None:
        if result.ok:
            log.info("ckptsup: committed step %d (stall %.3fs, write %.3fs, %d bytes)",
                     result.step, result.stall_s, result.write_s, result.bytes)
            self.reporter.emit(Event.CHECKPOINT_COMMITTED, step=result.step, stall_s=round(result.stall_s, 6),
                               write_s=round(result.write_s, 6), bytes=result.bytes, path=result.path)
            if self.keeper is not None:
                try:
                    self.keeper.after_commit(Path(result.path))
                except (CkptsupError, OSError) as err:  # housekeeping must never fail the training
                    log.error("ckptsup: housekeeping after step %d failed: %s", result.step, err)
        else:
            log.error("ckptsup: rank %d: checkpoint of step %d FAILED on every rank: %s (training continues; "
                      "the previous checkpoint is intact)", self.rank, result.step, result.reason)
            self.reporter.emit(Event.CHECKPOINT_FAILED, step=result.step, reason=result.reason)

    # ---- stopping -----------------------------------------------------------------------------
    def _stop(self, step: int) -> None:
        preempted = self.preempted
        command = self.channel.commands.stop_at or messages.StopAt()
        self.link.phases.enter(Phase.STOPPING, step)
        self.writer.wait()
        want = preempted or command.save
        budget = self.env.preempt_budget_s if command.budget_s is None else command.budget_s
        last = self.writer.last
        measured = last.total_s if last is not None and last.ok else None
        fits = want and emergency_save_fits(measured_save_s=measured, margin=self.settings.emergency_margin,
                                            budget_s=None if budget is None else float(budget),
                                            elapsed_s=self.stop.elapsed_s())
        saved = False
        if self.all_ok(fits) and self.last_saved_step != self.next_step:
            result = self.save(reason="preemption" if preempted else "stop", blocking=True)
            saved = bool(result and result.ok)
        log.warning("ckptsup: stopping after step %d (%s); emergency save %s", step,
                    "signal" if preempted else "stop_at", "written" if saved else "skipped")
        self._exit(ExitStatus.PREEMPTED if preempted else ExitStatus.RANK_STOPPED,
                   f"stopped after step {step}")

    def stop_now(self, *, preempted: bool = True) -> None:
        """Stop after the last completed step: a preemption (an emergency save when it fits) or a
        requested stop; raises SystemExit with PREEMPTED or RANK_STOPPED. Collective: every rank
        calls it at the same step (after an agreement, e.g. all_ok). For framework callbacks that
        learn of a stop outside step_done."""
        self.preempted = self.preempted or preempted
        self._stop(max(0, self.next_step - 1))

    def abandon(self, *, preempted: bool = False) -> None:
        """Shut down without a save (the framework's loop raised): the agent hears FAILURE, or
        PREEMPTED when a stop signal is why."""
        self._shutdown(status=int(ExitStatus.PREEMPTED if preempted else ExitStatus.FAILURE))

    def _exit(self, status: ExitStatus, message: str) -> None:
        self._shutdown(status=int(status))
        exit_rank(self.rank, status, message)

    def _shutdown(self, *, status: int, drain_s: float | None = 0.0) -> None:
        if self.closed:
            return
        self.closed = True
        self.writer.close()
        if self.memory is not None:
            self.memory.close()
        # Drop our references to our gloo groups: torch's registry keeps them until the script's
        # destroy_process_group(); a reference of ours (the Run sits in reference cycles) would
        # keep them past it, to be freed during interpreter teardown, where a gloo group can abort
        # the process (pytorch PR 179291). A suspect for the rare "terminate called without an
        # active exception" at the end of 2-rank test runs, not confirmed. We do not destroy them
        # ourselves: a peer may still be finishing the last collective on them.
        self.control_pg = self.writer.pg = None
        if self.keeper is not None:
            self.keeper.close(timeout_s=drain_s)  # at a preemption, never wait for promotions
            self.keeper = None
        self.link.bye(status)
        self.stop.uninstall()
        if self.lock is not None:
            self.lock.release()
        self.reporter.close()

    def close(self, *, final_save: bool = True) -> None:
        """Drain the in-flight save and write a final checkpoint (blocking)."""
        if self.closed:
            return
        # Draining saves, promotions and test loads make no step progress: tell the supervisor,
        # so that its stopping allowance (not the hang timeout) applies, even to a single rank.
        self.link.phases.enter(Phase.STOPPING, self.next_step)
        self.writer.wait()
        if final_save and self.next_step > 0:
            self.save(reason="final", blocking=True)
            self.link.phases.enter(Phase.STOPPING, self.next_step)  # a blocking save reports "train" when it ends
        if self.keeper is not None:
            self.keeper.close(timeout_s=self.settings.save_timeout_s)  # drain promotions and test loads
            self.keeper = None
        if not self.channel.connected and self.rank == 0:
            cost: dict[str, Any] = {} if self.replicas is None else {"sdc_s": round(self.replicas.seconds, 6)}
            self.reporter.emit(Event.RUN_COMPLETE, step=self.next_step, **cost)
        self._shutdown(status=int(ExitStatus.DONE))

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._shutdown(status=int(ExitStatus.FAILURE))

