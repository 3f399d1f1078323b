"""The node agent's view of its ranks as processes: which process is which rank (a hello's pid,
else torchrun's worker or the warm interpreter it handed its rank to), which exits were crashes,
which were clean, and what each live one is doing (docs/timeouts.md §Evidence).

A rank with hooks says `hello` and `bye`; a rank without hooks says nothing, so it is found
among torchrun's children by its RANK variable, and its clean exit is reported from its exit
status (or from being gone while torchrun and the other ranks carry on). A rank that left its
socket without `bye` is a crash unless its process exited 0 or torchrun exits 0 within
EXIT_CONFIRM_S. Every report goes out as a typed frame the caller sends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import psutil

from ... import messages
from ...stack_dump import stack_file
from . import evidence
from ..processes import GONE, RUNNING, Liveness, describe_exit, pid_views, where, zombie_status

EXIT_CONFIRM_S = 0.3  # a dropped rank connection becomes a crash report unless torchrun exits 0 by then
CLEAN_GONE_S = 2.0    # a worker reaped unseen, while torchrun and another rank carry on this long: it exited 0


@dataclass
class RankProcesses:
    """One attempt's rank processes on this node (`reset` at each launch)."""

    hooked: set[int] = field(default_factory=set)       # ranks that said hello this attempt: their steps come as frames
    workers: dict[int, int] = field(default_factory=dict)    # pid -> global rank of torchrun's workers (from their environment)
    rank_pids: dict[int, int] = field(default_factory=dict)  # global rank -> its process (hello pid, else the worker or its warm interpreter)
    host_pids: dict[int, int] = field(default_factory=dict)  # pid here -> pid in the outermost namespace /proc shows
    exits_seen: dict[int, float] = field(default_factory=dict)  # rank without hooks -> when its process was first seen gone
    exits_sent: set[int] = field(default_factory=set)        # ranks whose clean exit went up as rank_exit rc 0
    pending: list[tuple[float, int | None, int | None]] = field(default_factory=list)  # (seen, rank, pid): lost, unconfirmed
    trees: evidence.TreeSampler = field(default_factory=evidence.TreeSampler)   # each rank as its process tree

    def reset(self) -> None:
        self.hooked, self.workers, self.rank_pids = set(), {}, {}
        self.exits_seen, self.exits_sent, self.pending = {}, set(), []

    def said_hello(self, rank: int, pid: int | None) -> None:
        self.hooked.add(rank)
        if pid is not None:
            self.rank_pids[rank] = pid

    def clear_lost(self) -> None:
        """The ranks are being killed: no lost connection of theirs is a crash to confirm."""
        self.pending = []

    def lost(self, rank: int | None, pid: int | None, now: float) -> None:
        """A rank's connection ended without `bye`: a crash, once confirmed (`confirm`)."""
        self.pending.append((now, rank, pid))

    def scan(self, torchrun_pid: int | None, warm: Sequence[Any] = ()) -> dict[int, int]:
        """pid -> global rank of torchrun's live workers (their RANK variable; read once per pid).
        `warm`: the warm interpreters in use, by local rank: a worker's proxy stands in for one."""
        if torchrun_pid is None:
            return {}
        try:
            children = psutil.Process(torchrun_pid).children()
        except psutil.Error:
            return {}
        found = {}
        for child in children:
            pid, rank = child.pid, self.workers.get(child.pid)
            if rank is None:
                try:
                    env = child.environ()
                    rank, local_rank = int(env.get("RANK", "")), int(env.get("LOCAL_RANK", "-1"))
                except (psutil.Error, ValueError, OSError):
                    continue
                if 0 <= local_rank < len(warm):
                    pid = warm[local_rank].pid   # the proxy stands in for its warm interpreter: watch that
            found[pid] = rank
            if rank not in self.hooked:
                self.rank_pids.setdefault(rank, pid)
        self.workers = found
        return found

    def signal_unhooked(self, signum: int, torchrun_pid: int | None, warm: Sequence[Any] = ()) -> None:
        """Pass a stop to ranks that cannot hear stop_at: the script's own SIGTERM handler (its
        checkpoint-and-exit) runs, as under Slurm without ckptsup."""
        for pid, rank in self.scan(torchrun_pid, warm).items():
            if rank not in self.hooked:
                try:
                    os.kill(pid, signum)
                except OSError:
                    pass

    def confirm(self, torchrun_rc: int | None, now: float, step: int | None,
                warm: Sequence[Any] = ()) -> list[messages.RankExit]:
        """The lost ranks whose exit is now known to be a crash; the others wait or are let go.
        `warm`: the warm interpreters in use, whose status is ours to read (the agent reaps them):
        a killed one is a crash at once, not after EXIT_CONFIRM_S, so a peer that exits on the
        broken collective after it is never reported first."""
        if torchrun_rc == 0:
            self.pending = []
        in_use = {p.pid: p for p in warm}
        keep, crashes = [], []
        for seen, rank, pid in self.pending:
            status = GONE if pid is None else _status(pid, in_use)
            if status is RUNNING and now - seen < EXIT_CONFIRM_S:
                keep.append((seen, rank, pid))  # still exiting (fds close before the zombie appears)
            elif status is RUNNING:
                continue  # it closed its channel but lives on: not a crash (hang detection watches it)
            elif status == 0:
                continue  # a clean exit without `bye`
            elif status is GONE and now - seen < EXIT_CONFIRM_S and torchrun_rc is None:
                keep.append((seen, rank, pid))  # reaped already: wait for torchrun's verdict
            else:
                code = status if isinstance(status, int) else None   # GONE: reaped, no status left
                what = "died without saying goodbye" if code is None else describe_exit(code)
                crashes.append(messages.RankExit(rank=rank, rc=code, pid=pid, step=step, age_s=now - seen,
                                                 detail=f"rank {rank} (pid {pid}) {what}"))
        self.pending = keep
        return crashes

    def clean_exits(self, now: float, step: int | None, warm: Sequence[Any] = ()) -> list[messages.RankExit]:
        """Ranks without hooks say no bye: each one's clean exit (rank_exit rc 0), which starts the
        supervisor's exit_grace_s for the ranks left. Call while torchrun runs. A worker is
        torchrun's child and may be reaped before its status is read; gone while torchrun and
        another rank carry on for CLEAN_GONE_S means it exited 0 (a failed worker makes torchrun
        SIGTERM them all). `warm`: the warm interpreters in use (their status is ours to poll)."""
        in_use = {p.pid: p for p in warm}
        out = []
        for rank, pid in self.rank_pids.items():
            if rank in self.hooked or rank in self.exits_sent:
                continue
            status = _status(pid, in_use)
            if status is RUNNING:
                continue
            if status is GONE:
                seen = self.exits_seen.setdefault(rank, now)
                others = [p for r, p in self.rank_pids.items() if r != rank and zombie_status(p) is RUNNING]
                if now - seen < CLEAN_GONE_S or not others:
                    continue
                status = 0
                what = f"rank {rank} (pid {pid}) was gone while torchrun and the other ranks carried on: a clean exit"
            else:
                what = f"rank {rank} (pid {pid}) exited with status {status}"
            self.exits_sent.add(rank)   # a failure's status is torchrun's to report; read once either way
            if status == 0:
                out.append(messages.RankExit(rank=rank, rc=0, pid=pid, step=step, age_s=0.0, detail=what))
        return out

    def _host_pid(self, pid: int) -> int:
        if pid not in self.host_pids:
            self.host_pids[pid] = pid_views(pid)[1]
        return self.host_pids[pid]

    def pid_list(self) -> list[dict[str, int]]:
        """Every known rank's process, as this node sees it and as the outermost namespace does
        (`ckptsup status`: whom to signal or py-spy)."""
        return [{"rank": rank, "pid": pid, "host_pid": self._host_pid(pid)}
                for rank, pid in sorted(self.rank_pids.items()) if zombie_status(pid) is RUNNING]

    def survivors(self) -> list[dict[str, Any]]:
        """The rank processes still alive (a kill is about to end them), with where they wait."""
        return [{**entry, **where(entry["pid"])} for entry in self.pid_list()]

    def stacks(self, run_dir: str | None, attempt: int) -> messages.StacksTaken:
        """Every local rank's Python stacks, for a suspected hang (stack_dump.py)."""
        pids = {rank: pid for rank, pid in self.rank_pids.items() if zombie_status(pid) is RUNNING}
        files = {rank: stack_file(run_dir, attempt, rank) for rank in pids} if run_dir else {}
        taken = evidence.take_stacks(pids, files)
        wchan = {rank: w for rank, pid in pids.items() if (w := where(pid).get("wchan"))}
        # what each rank's workers wait in: a data wait past its allowance names them
        children = [[rank, c["pid"], c["state"], c["in"]] for rank, pid in sorted(pids.items())
                    for c in self.trees.blocked(pid)]
        return messages.StacksTaken(attempt=attempt, stacks=tuple([r, t] for r, t in sorted(taken.items())),
                                    wchan=tuple([r, w] for r, w in sorted(wchan.items())), children=tuple(children))

    def evidence(self, workers: dict[int, int]) -> tuple[list[dict[str, int]], dict[int, Any], set[int]]:
        """(pid list, rank -> evidence sample of its process tree, ranks without hooks whose process
        is stopped): a few /proc reads a process a heartbeat (evidence.TreeSampler)."""
        pids = self.pid_list()
        samples = {entry["rank"]: got for entry in pids if (got := self.trees.sample(entry["pid"])) is not None}
        self.trees.forget_except({entry["pid"] for entry in pids})
        stopped = set()
        for pid, rank in workers.items():
            if rank in self.hooked:
                continue
            # the evidence's state says stopped (T) too
            got = samples.get(rank) if self.rank_pids.get(rank) == pid else evidence.sample(pid)
            if got is not None and got.state == "T":
                stopped.add(rank)
        return pids, samples, stopped


def _status(pid: int, in_use: dict[int, Any]) -> "int | Liveness":
    """A rank process's exit status: a warm interpreter's from its handle (the agent's child, reaped
    by its poll, which keeps the status), any other's from /proc while it is a zombie."""
    if pid not in in_use:
        return zombie_status(pid)
    rc = in_use[pid].poll()
    return RUNNING if rc is None else rc
