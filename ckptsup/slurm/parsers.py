"""Pure parsers of Slurm command output (tested on literal text), and the classification of a
failed command's stderr as transient (retry) or permanent (raise)."""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any

import hostlist


class NodeState(enum.Enum):
    """A node's base state as sinfo's %T prints it (flags such as drain are folded in:
    DRAINED/DRAINING are their own members because that is what a scheduler decision needs)."""

    IDLE = "idle"
    ALLOCATED = "allocated"
    MIXED = "mixed"
    COMPLETING = "completing"
    DRAINING = "draining"      # drain requested, jobs still running
    DRAINED = "drained"
    DOWN = "down"
    FAIL = "fail"
    UNKNOWN = "unknown"
    OTHER = "other"

    @property
    def usable(self) -> bool:
        """Can this node take or keep work (when it also responds)?"""
        return self in (NodeState.IDLE, NodeState.ALLOCATED, NodeState.MIXED, NodeState.COMPLETING)


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    name: str
    state: NodeState
    responding: bool      # False when sinfo marks the state with '*' (slurmd not answering)
    reason: str           # drain/down reason, "" when none
    raw_state: str

    @property
    def healthy(self) -> bool:
        return self.responding and self.state.usable


_STATE_ALIASES = {"alloc": "allocated", "comp": "completing", "drng": "draining", "drain": "drained",
                  "mix": "mixed", "unk": "unknown", "fail": "fail", "failing": "fail", "idle": "idle",
                  "down": "down", "drained": "drained", "draining": "draining"}


def parse_node_state(raw: str) -> tuple[NodeState, bool]:
    """'idle' → (IDLE, True); 'down*' → (DOWN, False); 'idle+drain' → (DRAINED, True)."""
    text = raw.strip().lower()
    responding = not text.endswith("*")
    text = text.rstrip("*~#!%$@^-")
    parts = text.split("+")
    base = _STATE_ALIASES.get(parts[0], parts[0])
    flags = set(parts[1:])
    if "drain" in flags:
        base = "draining" if base in ("allocated", "mixed", "completing") else "drained"
    try:
        return NodeState(base), responding
    except ValueError:
        return NodeState.OTHER, responding


SINFO_NODE_FORMAT = "%N|%T|%E"


def parse_sinfo_nodes(text: str) -> dict[str, NodeInfo]:
    """Output of `sinfo -h -N -o '%N|%T|%E'` (one line per node and partition) → node → info."""
    out: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", 2)
        if len(parts) < 2:
            continue
        name, raw = parts[0].strip(), parts[1].strip()
        reason = parts[2].strip() if len(parts) > 2 else ""
        state, responding = parse_node_state(raw)
        out[name] = NodeInfo(name=name, state=state, responding=responding,
                             reason="" if reason in ("none", "(null)") else reason, raw_state=raw)
    return out


def parse_key_values(text: str) -> dict[str, str]:
    """`scontrol show node/job` text → {Key: value}. Values may contain spaces (Reason=...),
    so a value runs until the next ` Key=` token."""
    out: dict[str, str] = {}
    for match in re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_:/]*=|\s*$)",
                             text.strip(), flags=re.S):
        out.setdefault(match.group(1), match.group(2).strip())
    return out


class JobState(enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESIZING = "RESIZING"
    REVOKED = "REVOKED"
    SIGNALING = "SIGNALING"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    STAGE_OUT = "STAGE_OUT"
    STOPPED = "STOPPED"
    CONFIGURING = "CONFIGURING"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    OTHER = "OTHER"

    @property
    def finished(self) -> bool:
        return self in (JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED, JobState.TIMEOUT,
                        JobState.NODE_FAIL, JobState.BOOT_FAIL, JobState.DEADLINE,
                        JobState.OUT_OF_MEMORY, JobState.PREEMPTED, JobState.REVOKED,
                        JobState.SPECIAL_EXIT)


@dataclass(frozen=True, kw_only=True)
class JobInfo:
    job_id: str
    name: str
    state: JobState
    nodes: list[str]
    partition: str
    reason: str               # state_reason ("None", "BeginTime", "Resources", ...)
    requeue: bool
    restart_count: int
    batch_host: str
    excluded_nodes: list[str]
    exit_code: int | None     # the batch script's exit status when finished
    exit_signal: int | None   # the signal that killed it, when one did
    start_time: int | None = None  # epoch seconds the current run started (pending: Slurm's estimate)
    end_time: int | None = None    # epoch seconds the current run ends at its time limit (None: unknown or none)
    raw: dict[str, Any] = field(repr=False, compare=False)


def _expand(value: Any) -> list[str]:
    if not value:
        return []
    return hostlist.expand_hostlist(str(value))


# Slurm's job_state_string() (what squeue's %T prints): a state flag, when set, names the state
# before the base state does, in this order. 23.02+ JSON gives the base and its flags as a list
# (["PENDING", "COMPLETING"]: a requeued job still completing, not yet schedulable); 22.05 gives
# the %T string itself.
JOB_STATE_FLAG_ORDER = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED",
                        "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING")


def job_state_of(value: Any) -> JobState:
    """`job_state` of squeue --json, any version → the state %T would print."""
    names = [str(v).upper() for v in value] if isinstance(value, list) else [str(value).upper()]
    flags = [f for f in JOB_STATE_FLAG_ORDER if f in names[1:]]
    text = flags[0] if flags else (names[0] if names else "")
    try:
        return JobState(text)
    except ValueError:
        return JobState.OTHER


def _epoch(value: Any) -> int | None:
    """22.05 prints epoch seconds; newer data parsers print {"set": bool, "number": N}. 0 = unset."""
    if isinstance(value, dict):
        value = value.get("number") if value.get("set", True) and not value.get("infinite") else None
    return value if isinstance(value, int) and value > 0 else None


def _exit(job: dict[str, Any]) -> tuple[int | None, int | None]:
    """(exit status, signal). 22.05 prints the raw wait status (768 = exit 3, 9 = SIGKILL);
    newer data parsers print {"status": [...], "return_code": N, "signal": {"id": S}}."""
    code = job.get("exit_code")
    if isinstance(code, dict):
        rc = code.get("return_code")
        rc = rc.get("number") if isinstance(rc, dict) else rc
        sig = code.get("signal", {})
        sig = sig.get("id") if isinstance(sig, dict) else None
        sig = sig.get("number") if isinstance(sig, dict) else sig
        return (rc if isinstance(rc, int) else None), (sig if isinstance(sig, int) and sig else None)
    if not isinstance(code, int):
        return None, None
    return (code >> 8) & 0xFF, (code & 0x7F) or None


def parse_squeue_json(text: str) -> list[JobInfo]:
    """Output of `squeue --json` (Slurm 22.05 and later) → jobs."""
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"squeue --json printed invalid JSON: {err}") from None
    jobs = []
    for job in payload.get("jobs", []):
        jobs.append(JobInfo(
            job_id=str(job.get("job_id")),
            name=str(job.get("name", "")),
            state=job_state_of(job.get("job_state")),
            nodes=_expand(job.get("nodes")),
            partition=str(job.get("partition", "")),
            reason=str(job.get("state_reason", "")),
            requeue=bool(job.get("requeue", False)),
            restart_count=int(job.get("restart_cnt", 0) or 0),
            batch_host=str(job.get("batch_host", "") or ""),
            excluded_nodes=_expand(job.get("excluded_nodes")),
            exit_code=_exit(job)[0],
            exit_signal=_exit(job)[1],
            start_time=_epoch(job.get("start_time")),
            end_time=_epoch(job.get("end_time")),
            raw=job,
        ))
    return jobs


def json_errors(text: str) -> list[str]:
    """The `errors` of a Slurm `--json` answer ([] when none, or not JSON). Slurm may exit 0 with
    them: 22.05 answers an unreachable controller with "Failed while looking for jobs" and
    `"jobs": []`, which is a failed call, not an empty queue."""
    try:
        payload = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return []
    errors = payload.get("errors") if isinstance(payload, dict) else None
    if not isinstance(errors, list):
        return []
    out = []
    for err in errors:
        if isinstance(err, dict):
            parts = [str(err[k]) for k in ("source", "description", "error") if err.get(k)]
            out.append(": ".join(parts) or json.dumps(err))
        else:
            out.append(str(err))
    return out


def parse_sacct(text: str, fields: list[str]) -> list[dict[str, str]]:
    """`sacct -n -P -o F1,F2,...` ('|'-separated rows) → one dict per row."""
    rows = []
    for line in text.splitlines():
        if line.strip():
            values = line.split("|")
            rows.append(dict(zip(fields, values + [""] * (len(fields) - len(values)))))
    return rows


@dataclass(frozen=True, kw_only=True)
class StepInfo:
    """One step of a job as `squeue --steps` lists it while Slurm holds it (running or completing)."""

    step_id: str          # "123.4", "123.batch", "123.extern"
    name: str             # srun's --job-name (the command's name without one)
    nodes: list[str]


STEP_FORMAT = "%i|%j|%N"   # squeue --steps --format: step id, step name, node list


def parse_squeue_steps(text: str) -> list[StepInfo]:
    """`squeue --noheader --steps --format=%i|%j|%N` → its steps; lines of another shape are
    skipped (a step name holding "|" is cut at it, which no name of ours does)."""
    steps = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not parts[0]:
            continue
        steps.append(StepInfo(step_id=parts[0], name=parts[1], nodes=_expand(parts[-1])))
    return steps


def parse_sbatch_parsable(text: str) -> str:
    """`sbatch --parsable` prints 'JOBID' or 'JOBID;CLUSTER'."""
    first = text.strip().splitlines()[-1] if text.strip() else ""
    job_id = first.split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise ValueError(f"sbatch printed no job id: {text.strip()!r}")
    return job_id


# Failures worth retrying: the controller is busy, restarting or briefly unreachable.
_TRANSIENT = re.compile(
    r"socket timed out|unable to contact slurm controller|connection refused|"
    r"resource temporarily unavailable|zero bytes were transmitted|slurmctld.*busy|"
    r"temporarily unable to accept|communication connection failure|try again|"
    r"unable to (?:connect|establish)|connection reset by peer|transport endpoint",
    re.I)
# Slurm answers a non-admin's node update with "Invalid user id" (ESLURM_USER_ID_MISSING).
_PERMISSION = re.compile(r"access.?/?permission denied|invalid user for this operation|invalid user id|"
                         r"permission denied|not authorized", re.I)


# Answers that are Slurm's word on the request itself, never worth a retry.
_REFUSAL = re.compile(r"invalid job id|invalid partition|invalid node name|access denied|"
                      r"invalid user|unrecognized option|invalid (?:argument|option)", re.I)


def is_refusal(text: str) -> bool:
    return bool(_REFUSAL.search(text))


def is_transient(stderr: str) -> bool:
    return bool(_TRANSIENT.search(stderr))


def is_permission_denied(stderr: str) -> bool:
    return bool(_PERMISSION.search(stderr))


# Failures whose fix the user needs told: no cluster configured where the command ran.
_NO_CLUSTER = re.compile(r"could not establish a configuration source|unable to contact slurm controller|"
                         r"slurm\.conf.*no such file|cannot open.*slurm\.conf", re.I)
NO_CLUSTER_HINT = ("no Slurm cluster reachable from here: set SLURM_CONF to its slurm.conf "
                   "(for the local one: `eval $(ckptsup dev-cluster up)`)")


def failure_hint(stderr: str) -> str:
    """A one-clause fix for a Slurm failure we recognise, else ""."""
    return NO_CLUSTER_HINT if _NO_CLUSTER.search(stderr) else ""
