"""The effects the loop calls: environment for ranks, resume selection, health, node exclusion,
preemption stop, requeue, and the adaptive interval. Each is a small function of the supervisor
(`sv`, a loop.Supervisor); the decisions themselves live in policy.py / preemption.py / nccl.py."""

from __future__ import annotations

import os
import queue
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint.catalog import Status, list_checkpoints
from ..checkpoint.commit import parse_step
from ..checkpoint.validate import quarantine, validate
from ..config import Config
from ..env import ExitStatus
from ..errors import CkptsupError
from ..events import Event
from ..rundir import RunStatus
from .nccl import Timeouts, derive_timeouts, nccl_env
from .observations import AttemptResult, Failure, FailureKind
from .policy import Requeue
from .preemption import StopKind, plan_stop, stop_kind

if TYPE_CHECKING:
    from .loop import Supervisor

DUMP_WAIT_S = 2.0  # ranks' hooks thread writes the flight recorder; we do not wait longer than this


def checkpoint_dir(sv: "Supervisor") -> Path:
    configured = sv.config.checkpoint.dir
    return Path(configured.replace("{job_id}", sv.placement.job_id)) if configured else sv.run_dir.path / "checkpoints"


def rank_env(sv: "Supervisor", resume_from: str) -> dict[str, str]:
    """Everything ranks learn from the supervisor (env.py); the agent adds RANK_SOCKET and NODE."""
    from .. import env as envvars

    state, cfg = sv.state, sv.config
    timeouts = attempt_timeouts(sv)
    env = nccl_env(cfg, run_dir=sv.run_dir.path, attempt=state.attempt, timeouts=timeouts)
    ckpt = checkpoint_dir(sv)
    # the constants, not RankEnv.to_environ: RESUME_FROM="" (fresh start) must be set, not omitted
    env.update({
        envvars.RUN_DIR: str(sv.run_dir.path),
        envvars.JOB_ID: sv.placement.job_id,
        envvars.ATTEMPT: str(state.attempt),
        envvars.EPOCH: str(state.epoch),
        envvars.CONFIG_JSON: str(sv.run_dir.config_json_path),
        envvars.CHECKPOINT_DIR: str(ckpt),
        envvars.RESUME_FROM: resume_from,
        envvars.SECRET_FILE: str(sv.run_dir.secret_path),
        envvars.SAVE_EVERY_STEPS: str(cfg.checkpoint.save_every_steps),
        envvars.SAVE_EVERY_S: f"{sv.interval.current_s():g}",
        envvars.PREEMPT_BUDGET_S: f"{sv.interval.preempt_budget_s():.1f}",
    })
    if envvars.SITE_CONFIG in os.environ:
        env[envvars.SITE_CONFIG] = os.environ[envvars.SITE_CONFIG]
    return env


def attempt_timeouts(sv: "Supervisor") -> Timeouts:
    """The collective timeouts an attempt is launched with (fixed for its life), from the step
    and save times measured so far."""
    step_times = sv.tracker.step_window.samples if sv.tracker is not None else []
    save_times = [sv.state.measured["stall_s"]] if "stall_s" in sv.state.measured else []
    return derive_timeouts(sv.config, step_times=step_times, save_times=save_times)


def pick_resume(sv: "Supervisor") -> str:
    """The newest checkpoint that passes validation levels 1-2 (recorded validations at level ≥ 2
    are trusted); a failing one is quarantined and reported, and the previous one is tried."""
    for info in reversed(list_checkpoints(checkpoint_dir(sv))):
        if info.status not in (Status.COMMITTED, Status.VALIDATED):
            continue
        if info.validated_level >= 2:
            # validated earlier: re-check what can change cheaply (files present, sizes,
            # structure); the reader verifies every item's hash as it loads
            problems = recheck(info.path)
            if not problems:
                return str(info.path)
            reason = f"changed since its validation: {problems[0]}"
        else:
            result = validate(info.path, level=2)
            if result.ok:
                sv.emit(Event.CHECKPOINT_VALIDATED, step=info.step, level=2, duration_s=round(result.duration_s, 4))
                return str(info.path)
            reason = result.summary()
        where = quarantine(info.path, reason)
        sv.emit(Event.CHECKPOINT_REJECTED, step=info.step, level=2, reason=reason, quarantined=str(where))
    return ""


def recheck(step_dir: Path) -> list[str]:
    """Manifest, every listed file present with its size, and the structure (JSON only)."""
    from ..checkpoint.manifest import load_manifest
    from ..checkpoint.validate import check_level2, check_present

    try:
        manifest = load_manifest(step_dir)
    except CkptsupError as err:
        return [str(err)]
    return check_present(step_dir, manifest) or check_level2(step_dir, manifest)


def log_tail(attempt_dir: Path, lines: int = 3) -> str:
    """The errors at the end of the last attempt's rank logs (a traceback's last line), so a user
    error is visible where the give-up is reported."""
    out = []
    for log in sorted(attempt_dir.glob("ranks-*.log")):
        text = log.read_text(errors="replace").splitlines()
        errors = [x.strip() for x in text if re.match(r"^\s*[\w.]*(Error|Exception|Interrupt)\b", x)]
        if errors:
            out.append(f"--- {log}:")
            out.extend(dict.fromkeys(errors[-lines:]))
    return "\n".join(out) or f"(no error in the rank logs of {attempt_dir})"


def resume_step(resume_from: str) -> int:
    if not resume_from:
        return 0
    step = parse_step(Path(resume_from).name)
    return 0 if step is None else step  # step_<N> holds the state after N steps: resume at N


def health(sv: "Supervisor", nodes: list[str]) -> dict[str, str]:
    """{node: why} for every node among `nodes` that fails its checks (none when disabled)."""
    if not nodes or not sv.config.health.enabled:
        return {}
    from . import health as checks

    if sv.placement.in_slurm:
        results = checks.run_node_checks(nodes, sv.run_dir.path, sv.config, job_id=sv.placement.job_id)
    else:
        paths = checks.check_paths(sv.config, sv.run_dir.path, node=nodes[0], job_id=sv.placement.job_id)
        results = {nodes[0]: checks.NodeHealth(node=nodes[0], results=tuple(checks.run_local_checks(sv.config, paths,
                                                                                           node=nodes[0])))}
    bad = {}
    for node, result in results.items():
        sv.emit(Event.HEALTH_CHECK, node=node, ok=result.ok, detail=result.summary())
        if not result.ok:
            bad[node] = result.summary()
    return bad


def suspects(failure: Failure, earlier: list[AttemptResult], active: tuple[str, ...]) -> list[str]:
    """Nodes to health-check after a failure. A first crash is the software's until shown
    otherwise (fast path, no check); a hang, or a crash on a node that also failed the attempt
    before, makes the node suspect. Blamed nodes (dead, NaN) are excluded without a check."""
    if failure.kind is FailureKind.HANG or (failure.kind is FailureKind.NODE_DOWN and failure.node is None):
        nodes = list(failure.suspects)
    elif failure.kind is FailureKind.CRASH:
        before = earlier[-1].failure if earlier else None
        repeat = before is not None and before.node is not None and before.node == failure.node
        nodes = list(failure.suspects) if repeat else []
    else:
        nodes = []
    return [n for n in nodes if n in active]


def drain(sv: "Supervisor", node: str, reason: str) -> bool:
    """Drain a blamed node where permitted (Slurm only); exclusion is recorded regardless."""
    if not sv.placement.in_slurm or not sv.config.slurm.drain_bad_nodes or sv.placement.slurm is None:
        return False
    try:
        return bool(sv.placement.slurm.drain(node, f"ckptsup: {reason} job {sv.placement.job_id}"))
    except CkptsupError:
        return False


def dump_flight_recorder(sv: "Supervisor") -> None:
    """Before killing hung ranks, ask their hooks thread to dump the flight recorder (NCCL keeps
    one; gloo on CPU does not, so without GPUs there is nothing to wait for). Waits for every
    rank's `fr_dumped` or DUMP_WAIT_S, whichever comes first."""
    nccl = sv.config.nccl
    if sv.step is None or not (nccl.dump_on_timeout and nccl.flight_recorder_entries > 0
                               and sv.config.sbatch.gpus_per_node > 0):
        return
    path = sv.run_dir.attempt_dir(sv.state.attempt) / "flight_recorder"
    sv.step.send("dump_fr", {"path": str(path)})
    waiting = set(sv.tracker.ranks) if sv.tracker is not None else set()
    deadline = sv.clock() + DUMP_WAIT_S
    while waiting and sv.clock() < deadline:
        try:
            msg = sv.inbox.get(timeout=0.05)
        except queue.Empty:
            continue
        record = msg.body.get("record") if msg.m == "event" else None
        if isinstance(record, dict) and record.get("event") == "fr_dumped":
            waiting.discard(record.get("rank"))


def stop_for_preemption(sv: "Supervisor", failure: Failure) -> ExitStatus:
    """Ask the ranks to agree on a stop step and save if it fits; wait (bounded); requeue."""
    signum = sv.stop_signal or signal.SIGTERM
    kind = stop_kind(signum) if sv.stop_signal is not None else StopKind.PREEMPTION
    plan = plan_stop(kind=kind, config=sv.config, save_s=sv.state.measured.get("stall_s"),
                     grace_time_s=sv.interval.grace_time_s, step_p99_s=sv.tracker.step_window.p99() if sv.tracker else None)
    sv.emit(Event.PREEMPTION, **plan.as_event())
    step = sv.step
    if step is not None and step.alive():
        step.send("stop_at", {"reason": kind.value, "save": plan.emergency_save,
                              "budget_s": plan.budget_s})
        deadline = sv.clock() + plan.budget_s + sv.sup.kill_grace_s
        waiting = set(sv.active)
        while waiting and sv.clock() < deadline and step.alive():
            try:
                msg = sv.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg.m == "event":
                sv._forward_event(msg.body.get("record"))
            elif msg.m == "torchrun_exit":
                waiting.discard(msg.node)
        step.send("kill", {"grace": 0})
    return requeue(sv, Requeue(reason=f"{kind.value}: {failure.detail}", preempted=True))


def requeue(sv: "Supervisor", action: Requeue) -> ExitStatus:
    """Inside Slurm: D2's requeue path (fenced, excluded nodes, spanning partition). Outside:
    nothing can requeue; a preempted local run exits PREEMPTED, anything else gives up."""
    status = ExitStatus.PREEMPTED if action.preempted else ExitStatus.REQUEUE
    if not sv.placement.in_slurm:
        if action.preempted:
            sv.state.status = RunStatus.STOPPED
            sv.run_dir.save_state(sv.state)
            return ExitStatus.PREEMPTED
        sv.emit(Event.GIVE_UP, reason=f"requeue needed ({action.reason}) but not inside Slurm")
        sv.state.status = RunStatus.GAVE_UP
        sv.run_dir.save_state(sv.state)
        return ExitStatus.GIVE_UP
    from .requeue import RequeueRefused, requeue_job

    if sv.step is not None:
        sv.step.abandon()  # ranks are already killed; srun may hang on a dead node's step: don't wait
        sv.step = None
    sv.run_dir.save_state(sv.state)
    if sv.writer is not None:
        sv.writer.close()  # requeue_job appends the fenced `requeue` event itself
    try:
        requeue_job(sv.placement.slurm, sv.run_dir, sv.placement.job_id, action.reason,
                    exclude=list(action.exclude), partition=sv.config.slurm.spare_partition or None)
    except RequeueRefused as err:
        sv.state = sv.run_dir.load_state()
        sv.emit(Event.GIVE_UP, reason=str(err))
        sv.state.status = RunStatus.GAVE_UP
        sv.run_dir.save_state(sv.state)
        print(f"ckptsup: {err}", flush=True)
        return ExitStatus.GIVE_UP
    except CkptsupError as err:  # e.g. Slurm already requeued a preempted job: the template retries
        print(f"ckptsup: requeue failed: {err}; leaving it to the batch script", flush=True)
    return status


class IntervalTuner:
    """Wires planning.adaptive.AdaptiveInterval (E) into the loop: feeds it events, reports new
    intervals. Off when checkpoint.adaptive_interval is false."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.grace_time_s: float | None = None
        self._current = float(config.checkpoint.save_every_s)
        self._adaptive = None
        if config.checkpoint.adaptive_interval:
            from ..planning.adaptive import AdaptiveInterval

            per_node = config.sbatch.gpus_per_node or config.supervisor.nproc_per_node
            self._adaptive = AdaptiveInterval(gpu_mtbf_hours=config.cost.gpu_mtbf_hours,
                                              devices=max(1, config.supervisor.nodes or 1) * per_node,
                                              initial_interval_s=self._current)

    def current_s(self) -> float:
        return self._current

    def observe(self, record: dict[str, Any]) -> tuple[float, str] | None:
        if self._adaptive is None:
            return None
        change = self._adaptive.observe(record)
        if change is not None:
            self._current = change[0]
        return change

    def note_save(self, record: dict[str, Any]) -> None:
        """Checkpoint costs arrive as forwarded events; observe() already saw them."""

    def preempt_window_s(self) -> float:
        return float(self.grace_time_s or 0.0)

    def preempt_budget_s(self) -> float:
        """What ranks may spend after a preemption SIGTERM (they check the save fits)."""
        from .preemption import STOP_RESERVE_S

        return max(0.0, float(self.grace_time_s or 0.0) - STOP_RESERVE_S)
