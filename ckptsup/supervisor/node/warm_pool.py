"""The agent's pool of warm rank interpreters (rankside/warm_rank.py): one per local rank,
forked by the agent's zygote (zygote.py; it imported torch with the ranks' environment) as soon
as the current attempt has started (agent._warm_standby), handed out to the next launch's workers through
rankside/warm_proxy.py. One generation serves one launch; the next one is forked afterwards.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..processes import is_stopped, terminate
from .forked import ForkedChild
from .zygote import Zygote


@dataclass(kw_only=True)
class WarmPool:
    directory: Path                       # the agent's 0700 socket dir
    size: int
    cwd: str = "."
    generation: int = 0
    procs: list[ForkedChild] = field(default_factory=list)    # waiting, not handed out
    in_use: list[ForkedChild] = field(default_factory=list)   # the current launch's ranks
    failed: int = 0                       # generations that died before they were used
    MAX_FAILED = 2

    @staticmethod
    def rank_env(env: dict[str, str], nproc_per_node: int) -> dict[str, str]:
        """What the ranks' interpreters see at import: torchrun's OMP_NUM_THREADS rule applied."""
        out = dict(env)
        if nproc_per_node > 1:
            out.setdefault("OMP_NUM_THREADS", "1")
        return out

    in_use_dir: Path | None = None        # the generation handed out (WARM_DIR of the launch)

    @property
    def generation_dir(self) -> Path:
        """One directory per generation: a waiting interpreter never takes an in-use one's path."""
        return self.directory / f"warm-{self.generation}"

    def socket(self, local_rank: int) -> Path:
        return self.generation_dir / f"warm-{local_rank}.sock"

    def start(self, zygote: Zygote) -> None:
        """Fork one warm interpreter per local rank (replacing none that is still waiting)."""
        if self.procs or self.failed >= self.MAX_FAILED:
            return
        self.generation += 1
        self.generation_dir.mkdir(mode=0o700, exist_ok=True)
        for local_rank in range(self.size):
            child = zygote.fork_warm(listen=self.socket(local_rank), local_rank=local_rank, cwd=self.cwd)
            if child is None:   # the zygote failed: this generation is spoilt
                self._spoil()
                return
            self.procs.append(child)

    def ready(self) -> bool:
        """Every interpreter imported torch and can answer now: a stopped one (SIGSTOP) is not
        ready, so the launch starts cold instead of handing a rank to a process that never runs."""
        return bool(self.procs) and len(self.procs) == self.size and all(
            p.poll() is None and Path(f"{self.socket(i)}.ready").exists() and not is_stopped(p.pid)
            for i, p in enumerate(self.procs))

    def hand_out(self) -> bool:
        """The next launch uses this generation (its workers connect through warm_proxy);
        False when it is not ready (the launch starts cold)."""
        if not self.ready():
            return False
        self._remove(self.in_use_dir)
        self.in_use, self.procs, self.in_use_dir = self.procs, [], self.generation_dir
        return True

    def signal_in_use(self, sig: int) -> None:
        """Signal the launch's ranks now, waiting for nothing: killed first, they exit while
        torchrun's tree is walked and waited on (kill_in_use then only reaps them)."""
        for proc in self.in_use:
            proc.send_signal(sig)

    def kill_in_use(self) -> None:
        """The launch's ranks are being killed: a warm rank that is stopped (SIGSTOP) would not
        notice its proxy's death, so kill them directly."""
        for proc in self.in_use:
            terminate(proc, 0)
        self.in_use = []

    def reap(self) -> None:
        """Collect exited ranks; a warm interpreter that died while waiting (its torch import
        failed?) or is stopped (it would never answer) spoils its generation: the next start() tries once more, then warming stops."""
        for proc in self.in_use:
            proc.poll()
        if any(p.poll() is not None or is_stopped(p.pid) for p in self.procs):
            self._spoil()

    def _spoil(self) -> None:
        """This generation will not serve a launch: kill what is waiting, count the failure."""
        for proc in self.procs:
            terminate(proc, 0)
        self.procs = []
        self.failed += 1

    def close(self) -> None:
        self.kill_in_use()
        for proc in self.procs:
            terminate(proc, 0)
        self.procs = []
        self._remove(self.in_use_dir)
        self._remove(self.generation_dir)

    @staticmethod
    def _remove(directory: Path | None) -> None:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
