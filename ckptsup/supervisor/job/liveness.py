"""Busy is not hung (docs/timeouts.md §Evidence): once an attempt has shown no progress for its
allowance it is only *suspect*. Pure: from what the agents measured of every rank, the verdict.

- first the agents are asked for every rank's stack (waited for at most STACK_WAIT_S, asked again
  every STACKS_FRESH_S while the suspicion lasts);
- a rank whose CPU time or I/O grew above the noise floor through the last EVIDENCE_WINDOW_S, and
  that is not blocked in a c10d call (a spinning wait), is working: the attempt is BUSY (an
  evaluation, a compile, a data phase), killed only past `busy_limit_s`. A rank is its process
  tree: its DataLoader workers' CPU and I/O are its own (node/evidence.py);
- a rank whose main thread waits on its own data (torch.utils.data frames: the loader's queue, a
  dataset's read) is *waiting for data*, busy too, whether its workers compute or sit in a
  stalled read; past `busy_limit_s` it is the hang, named with what its workers wait in;
- otherwise the stacks decide who is stuck: the culprit is the rank that is *not* in the
  collective the others wait in;
- a rank in uninterruptible sleep (D: a file system, a device) points at its node; a deadlock in
  user code is the job's own: no node is suspected for it.

Measured noise (this 2-core box, BENCHMARKS.md §Liveness): a rank blocked in a gloo all-reduce or
sleeping uses 0.005 cores and does no I/O; a computing rank uses ~1 core, ≥ 0.3 on a loaded box.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

EVIDENCE_WINDOW_S = 5.0      # the last seconds of the silence that must show no work
CPU_FLOOR = 0.05             # cores: 10 x an idle rank's
IO_FLOOR_BPS = 4096.0        # bytes/s of rchar + wchar: an idle rank does none
STACK_WAIT_S = 4.0           # how long a verdict waits for the stacks it asked for (agents on a loaded box answer late)
STACKS_FRESH_S = 30.0        # a busy spell's stacks are asked for again this often (has it stopped working?)
KEEP_S = 30.0                # samples kept per rank
STALE_S = 3.0                # a rank whose last sample is older has left its agent's list (exited, reaped)

# frames of a rank that waits for its peers when nothing works: c10d calls, and autograd (DDP's
# reducer all-reduces inside backward); only a c10d call outweighs CPU time (a spinning wait), as
# a backward that computes is work
_WAITING = re.compile(r"/torch/(distributed|autograd)/")
_IN_C10D = re.compile(r"/torch/distributed/")
_IN_AUTOGRAD = re.compile(r"/torch/autograd/")
# a main thread in the data pipeline: DataLoader's queue get (_get_data, _try_get_data), its
# fetchers, an IterableDataset's read under them; torchdata's StatefulDataLoader (torchtitan's) is a
# copy of DataLoader's code under its own path
_DATA = re.compile(r"/torch/utils/data/|/torchdata/")
# kernel wait channels of a main thread that waits for another thread or a peer (a gloo or NCCL
# wait sits on a futex or polls a socket); anything else (a nanosleep, a pipe, a disk) is elsewhere
_WAITING_WCHAN = re.compile(r"futex|poll|select|sk_wait|wait_woken")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass(kw_only=True)
class RankEvidence:
    """One rank process as its agent measures it, on the supervisor's clock."""

    rank: int
    node: str
    state: str = ""
    children: int = 0     # live descendants (DataLoader workers, subprocesses) at the last sample
    samples: deque[tuple[float, float, int, float]] = field(default_factory=deque)   # (mono, cpu_s, io_bytes, children_cpu_s)

    def add(self, now: float, cpu_s: float, io_bytes: int, state: str, children: int = 0,
            children_cpu_s: float = 0.0) -> None:
        if self.samples and (cpu_s < self.samples[-1][1] or io_bytes < self.samples[-1][2]):
            self.samples.clear()   # another process now holds the rank (a restart): start over
        self.samples.append((now, cpu_s, io_bytes, children_cpu_s))
        self.state, self.children = state, children
        while self.samples and now - self.samples[0][0] > KEEP_S:
            self.samples.popleft()

    def stale(self, now: float) -> bool:
        """Sampled before, but not lately: the agent stopped listing the process (it exited)."""
        return bool(self.samples) and now - self.samples[-1][0] > STALE_S

    def rates(self, now: float, window_s: float = EVIDENCE_WINDOW_S) -> tuple[float, float] | None:
        """(cores, bytes/s) over the last `window_s`; None while the samples span less."""
        inside = self._inside(now, window_s)
        if inside is None:
            return None
        (t0, c0, i0, _), (t1, c1, i1, _) = inside
        span = max(t1 - t0, 1e-6)
        return (c1 - c0) / span, (i1 - i0) / span

    def children_cores(self, now: float, window_s: float = EVIDENCE_WINDOW_S) -> float | None:
        """The live descendants' CPU over the window, in cores (a worker that exited meanwhile
        leaves it: a floor of 0)."""
        inside = self._inside(now, window_s)
        if inside is None:
            return None
        (t0, _, _, k0), (t1, _, _, k1) = inside
        return max(0.0, (k1 - k0) / max(t1 - t0, 1e-6))

    def _inside(self, now: float, window_s: float
                ) -> tuple[tuple[float, float, int, float], tuple[float, float, int, float]] | None:
        inside = [s for s in self.samples if now - s[0] <= window_s + 1.0]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < window_s * 0.6:
            return None
        return inside[0], inside[-1]


class Where(enum.StrEnum):
    WAITING = "waiting"     # in a collective (or backward: DDP's all-reduce)
    DATA = "data"           # waiting for its own data: the DataLoader's queue, a dataset's read
    ELSEWHERE = "elsewhere"  # anywhere else: the script's own code, a library, a sleep


@dataclass(frozen=True, kw_only=True)
class Stack:
    """A rank's main thread, from its faulthandler dump (most recent call first)."""

    frames: tuple[tuple[str, int, str], ...]   # (file, line, function)

    @property
    def where(self) -> Where:
        """The innermost telling frame decides: a collective near the top (a rank inside its
        dataset that waits in a collective is in the collective), else a data-pipeline frame
        anywhere (a dataset's own read is deep under the loader's frames)."""
        for depth, (f, _, _) in enumerate(self.frames):
            if depth < 12 and _WAITING.search(f):
                return Where.WAITING
            if _DATA.search(f):
                return Where.DATA
        return Where.ELSEWHERE

    @property
    def in_c10d(self) -> bool:
        """Blocked in a collective call: CPU time it burns is a spinning wait, not work."""
        return any(_IN_C10D.search(f) for f, _, _ in self.frames[:12])

    @property
    def in_autograd(self) -> bool:
        return any(_IN_AUTOGRAD.search(f) for f, _, _ in self.frames[:12])

    def caller(self) -> str:
        """The script's own line that led here (the innermost frame outside libraries): where a
        waiting rank entered its collective."""
        user = [fr for fr in self.frames if not _library(fr[0])]
        return f"{_short(user[0][0])}:{user[0][1]}" if user else "?"

    def top(self) -> str:
        """The frame to name: the innermost one outside the standard library and ckptsup."""
        if not self.frames:
            return "no Python frame"
        if self.where is Where.WAITING:
            f, line, func = next(fr for fr in self.frames if _WAITING.search(fr[0]))
            return f"waiting in {func} ({_short(f)}:{line})"
        if self.where is Where.DATA:
            f, line, func = next(fr for fr in self.frames if _DATA.search(fr[0]))
            return f"waiting for data in {func} ({_short(f)}:{line}) from {self.caller()}"
        user = [fr for fr in self.frames if not _library(fr[0])] or list(self.frames)
        f, line, func = user[0]
        return f"at {_short(f)}:{line} in {func}"


@dataclass(frozen=True, kw_only=True)
class KernelWait:
    """A rank without a Python stack: where its main thread waits in the kernel (/proc/PID/wchan).
    Weaker than a stack: a futex is a collective's wait or a lock's alike."""

    wchan: str

    @property
    def where(self) -> Where:
        return Where.WAITING if _WAITING_WCHAN.search(self.wchan) else Where.ELSEWHERE

    def top(self) -> str:
        what = "waiting" if self.where is Where.WAITING else "sleeping" if "sleep" in self.wchan else "blocked"
        return f"{what} in the kernel ({self.wchan})"


def parse_stack(text: str) -> Stack | None:
    """The main thread of a faulthandler dump: its last thread block (threads are listed newest
    first, and the main thread is the oldest)."""
    blocks: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        elif blocks and (m := _FRAME.match(line)):
            blocks[-1].append((m["file"], int(m["line"]), m["func"]))
    return Stack(frames=tuple(blocks[-1])) if blocks else None


def _library(path: str) -> bool:
    return "/lib/python3" in path or "/site-packages/" in path or path.startswith("<frozen")


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]


@dataclass(frozen=True, kw_only=True)
class Working:
    """Busy, not hung: these ranks work without progress."""

    ranks: tuple[int, ...]
    detail: str
    data: tuple[int, ...] = ()    # those of them waiting for their own data (their main thread in the data pipeline)


@dataclass(frozen=True, kw_only=True)
class NeedStacks:
    """Nothing works: ask the agents where every rank is before naming anyone."""


@dataclass(frozen=True, kw_only=True)
class RankSeen:
    """What one rank was doing when its attempt was judged hung: `failure_detected.ranks_seen`
    (docs/contracts.md), for `ckptsup log --json` and whoever reads the stacks after."""

    rank: int
    node: str
    where: str            # Where, or "no stack"
    top: str              # the frame (or kernel wait) that names it
    state: str            # /proc state letter ("" unknown)
    cores: float | None   # CPU over the evidence window
    io_bps: float | None  # rchar + wchar per second over it

    def to_record(self) -> dict[str, object]:
        return {"rank": self.rank, "node": self.node, "where": self.where, "top": self.top, "state": self.state,
                "cores": None if self.cores is None else round(self.cores, 3),
                "io_bps": None if self.io_bps is None else round(self.io_bps)}


@dataclass(frozen=True, kw_only=True)
class Hung:
    culprits: tuple[int, ...]           # the ranks stuck elsewhere than their peers (empty: unknown)
    node_evidence: tuple[str, ...]      # nodes the evidence points at (D state): suspects
    detail: str
    ranks: tuple[RankSeen, ...] = ()    # every rank's evidence, by rank


@dataclass(frozen=True, kw_only=True)
class Leaving:
    """Every rank's process has left its agent's list and none gave a stack: they exited (a slow
    end of the run: torchrun has reaped them but not exited yet). Not evidence of a hang; the
    launcher's exit says how they ended."""

    detail: str


Verdict = Working | NeedStacks | Leaving | Hung


def judge(evidence: Mapping[int, RankEvidence], stacks: Mapping[int, str], *, now: float,
          stacks_asked_at: float | None, stacks_answered: bool, wchan: Mapping[int, str] | None = None) -> Verdict:
    """The verdict on a suspect attempt (no progress through its allowance). `stacks_answered`:
    every agent asked has answered (with the stacks its ranks could give, and every rank's kernel
    wait channel, the evidence for a rank without a stack)."""
    parsed: dict[int, Stack | KernelWait] = {r: s for r, text in stacks.items() if (s := parse_stack(text)) is not None}
    for rank, channel in (wchan or {}).items():
        parsed.setdefault(rank, KernelWait(wchan=channel))
    if stacks_asked_at is None or (stacks_answered and now - stacks_asked_at > STACKS_FRESH_S):
        return NeedStacks()   # before any verdict: a rank spinning inside a collective is no worker
    if not stacks_answered and now - stacks_asked_at < STACK_WAIT_S:
        return NeedStacks()
    working, data, shown = [], [], []
    for rank, ev in sorted(evidence.items()):
        if ev.state in ("T", "t", "Z"):
            continue
        rates = ev.rates(now)
        stack = parsed.get(rank)
        if isinstance(stack, Stack) and stack.where is Where.DATA:
            # its workers compute, or wait in a read as stalled as a network's: either way the
            # data pipeline has the rank, not a peer or its own code
            working.append(rank)
            data.append(rank)
            shown.append(f"rank {rank} {data_wait(ev, now)}")
            continue
        if rates is None:
            continue
        cores, io = rates
        spinning = isinstance(stack, Stack) and stack.in_c10d
        if (cores >= CPU_FLOOR or io >= IO_FLOOR_BPS) and not spinning:
            working.append(rank)
            shown.append(f"rank {rank} ({cores:.2f} cores, {io / 1024:.0f} KiB/s I/O)")
    if working:
        return Working(ranks=tuple(working), data=tuple(data), detail=f"working without progress: {', '.join(shown)}")
    if evidence and not parsed and all(ev.stale(now) for ev in evidence.values()):
        # no rank left to judge: counting "no evidence" as "not working" blamed exiting ranks
        return Leaving(detail=f"{_ranks(sorted(evidence))}: no longer running (no sample for {STALE_S:g}s, no stack)")
    return _name(evidence, parsed, now)


def data_wait(ev: RankEvidence, now: float) -> str:
    """'waiting for data (2 workers, 85% CPU)': what a rank's data pipeline is doing."""
    kids = ev.children_cores(now)
    cpu = "" if kids is None else f", {kids * 100:.0f}% CPU"
    if ev.children:
        return f"waiting for data ({ev.children} worker{'s' if ev.children != 1 else ''}{cpu})"
    rates = ev.rates(now)
    own = "" if rates is None else f", {rates[0] * 100:.0f}% CPU, {rates[1] / 1024:.0f} KiB/s I/O"
    return f"waiting for data (no worker processes: the rank reads itself{own})"


@dataclass(frozen=True, kw_only=True)
class ChildSeen:
    """A live descendant of a rank (a DataLoader worker), as its agent saw it with the stacks."""

    pid: int
    state: str
    waiting_in: str   # "read()", a kernel wait channel, or "" (running)

    def describe(self) -> str:
        where = f"in {self.waiting_in}" if self.waiting_in else "running" if self.state == "R" else f"state {self.state}"
        return f"worker pid {self.pid} {where}" + (" (uninterruptible I/O, state D)" if self.state == "D" else "")


def data_hang(busy: Working, evidence: Mapping[int, RankEvidence], stacks: Mapping[int, str],
              children: Mapping[int, list[ChildSeen]], *, now: float, for_s: float) -> Hung:
    """A data wait past the busy allowance: the hang is the first rank waiting for data (its
    peers wait for it in a collective), named with what its workers wait in. A worker in
    uninterruptible I/O points at its node (a file system); a stalled read is the data source's."""
    parsed: dict[int, Stack | KernelWait] = {r: st for r, text in stacks.items() if (st := parse_stack(text)) is not None}
    culprits = busy.data
    parts = []
    for rank in culprits:
        ev = evidence.get(rank)
        where = parsed.get(rank)
        kids = children.get(rank, [])
        shown = "; ".join(c.describe() for c in kids[:4]) + (f" (and {len(kids) - 4} more)" if len(kids) > 4 else "")
        parts.append(f"rank {rank} on {ev.node if ev is not None else '?'} waiting for data for {for_s:.0f}s"
                     f" ({where.top() if where is not None else 'no stack'})" + (f"; {shown}" if shown else "; no worker processes"))
    others = [r for r in sorted(parsed) if r not in culprits]
    if others:
        tops = {parsed[r].top() for r in others}
        parts.append(f"{_ranks(others)} {tops.pop() if len(tops) == 1 else 'elsewhere'}")
    nodes = tuple(sorted({evidence[r].node for r in culprits if r in evidence
                          and any(c.state == "D" for c in children.get(r, []))}))
    return Hung(culprits=culprits, node_evidence=nodes, detail="; ".join(parts), ranks=_seen(evidence, parsed, now))


def _seen(evidence: Mapping[int, RankEvidence], parsed: Mapping[int, Stack | KernelWait], now: float) -> tuple[RankSeen, ...]:
    out = []
    for rank in sorted(set(evidence) | set(parsed)):
        ev, where = evidence.get(rank), parsed.get(rank)
        rates = ev.rates(now) if ev is not None else None
        out.append(RankSeen(rank=rank, node=ev.node if ev is not None else "?",
                            where=where.where.value if where is not None else "no stack",
                            top=where.top() if where is not None else "no stack", state=ev.state if ev is not None else "",
                            cores=rates[0] if rates else None, io_bps=rates[1] if rates else None))
    return tuple(out)


def _desync(parsed: Mapping[int, Stack | KernelWait]) -> tuple[int, ...]:
    """Every rank waits, each in a collective, but not all entered from the same line of the
    script: collectives that never match (a rank in a second group's all-reduce while its peers
    wait in DDP's). The ranks at the rarer line are the ones that left the common path; on a
    tie, the ones in an explicit call rather than in backward (DDP's all-reduce is what every
    step does). Needs Python stacks: kernel wait channels cannot tell collectives apart."""
    stacks = {r: s for r, s in parsed.items() if isinstance(s, Stack)}
    if len(stacks) < 2 or len(stacks) != len(parsed) or any(s.where is not Where.WAITING for s in stacks.values()):
        return ()
    sites: dict[str, list[int]] = {}
    for rank, stack in sorted(stacks.items()):
        sites.setdefault(stack.caller(), []).append(rank)
    if len(sites) < 2:
        return ()
    rarest = min(len(ranks) for ranks in sites.values())
    groups = [ranks for ranks in sites.values() if len(ranks) == rarest]
    explicit = [ranks for ranks in groups if not any(stacks[r].in_autograd for r in ranks)]
    return tuple(sorted((explicit or groups)[0]))


def _name(evidence: Mapping[int, RankEvidence], parsed: Mapping[int, Stack | KernelWait], now: float) -> Hung:
    stuck_in_io = tuple(sorted({ev.node for ev in evidence.values() if ev.state == "D"}))
    elsewhere = sorted(r for r, s in parsed.items() if s.where is not Where.WAITING)
    waiting = sorted(r for r, s in parsed.items() if s.where is Where.WAITING)
    culprits = tuple(elsewhere) if elsewhere and (waiting or len(parsed) == 1) else ()
    desync = () if culprits else _desync(parsed)
    if desync:
        # the job's own code, not a node: named with where each side entered its collective
        stacks = {r: st for r, st in parsed.items() if isinstance(st, Stack)}   # every rank's, for a desync
        side = "; ".join(f"rank {r} on {evidence[r].node if r in evidence else '?'}: {stacks[r].top()} from "
                         f"{stacks[r].caller()}" for r in desync)
        rest = "; ".join(f"rank {r} {stacks[r].top()} from {stacks[r].caller()}" for r in sorted(stacks) if r not in desync)
        return Hung(culprits=desync, node_evidence=stuck_in_io, ranks=_seen(evidence, parsed, now),
                    detail=f"{_ranks(desync)} in a collective its peers never enter: {side}; {rest}")
    parts = []
    for rank in culprits:
        node = evidence[rank].node if rank in evidence else "?"
        state = " (uninterruptible I/O, state D)" if rank in evidence and evidence[rank].state == "D" else ""
        parts.append(f"rank {rank} on {node}: {parsed[rank].top()}{state}")
    others = [r for r in sorted(parsed) if r not in culprits]
    if others:
        tops = {parsed[r].top() for r in others}
        where = tops.pop() if len(tops) == 1 else "elsewhere"
        parts.append(f"{_ranks(others)} {where}")
    missing = sorted(set(evidence) - set(parsed))
    if missing:
        parts.append(f"{_ranks(missing)}: no stack (started cold without hooks, or not answering)")
    return Hung(culprits=culprits, node_evidence=stuck_in_io, detail="; ".join(parts) or "no evidence of work",
                ranks=_seen(evidence, parsed, now))


def _ranks(ranks: Iterable[int]) -> str:
    rs = list(ranks)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(str(r) for r in rs)
