"""Running examples/train.py for the hooks tests: real torch, real torchrun (gloo), real files."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import psutil

from ckptsup import wire

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fast_site_config() -> str:
    """A site config without daily keepers or periodic level-3 test loads: each test load is a
    fresh process importing torch, too slow to run after every tiny test run on 2 cores. One test
    (test_hooks_api) keeps the shipped defaults and checks the housekeeping does run."""
    import tempfile

    path = Path(tempfile.gettempdir()) / f"ckptsup-hooks-tests-site-{os.getuid()}.toml"
    if not path.exists():
        path.write_text("[checkpoint]\nkeep_daily_days = 0\ntest_load_every = 0\n")
    return str(path)


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSUP_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CKPTSUP_SAVE_EVERY_S": "3600",
                "CKPTSUP_SITE_CONFIG": fast_site_config()})
    env.update(extra or {})
    return env


def train_argv(nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        return [PY, str(TRAIN), *args]
    return [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(TRAIN), *args]


def run_train(nproc: int, args: list[str], *, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(train_argv(nproc, args), env=base_env(env), capture_output=True, text=True, timeout=timeout)


class Running:
    """A training run in the background whose output lines are collected as they come."""

    def __init__(self, nproc: int, args: list[str], *, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(train_argv(nproc, args), env=base_env(env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None and not predicate():
                raise AssertionError(f"run ended (rc={self.proc.returncode}) first:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.02)
        raise AssertionError("timed out waiting; output:\n" + "\n".join(self.lines[-30:]))

    def saw(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def sigkill_all(self) -> None:
        """SIGKILL torchrun and every rank at once (ranks run in their own sessions)."""
        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)

    def finish(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return rc


def read_samples(out: Path, rank: int) -> dict[int, list[int]]:
    """step -> sample ids of that step on `rank`; a step logged twice (replayed after a resume) must
    have logged the same ids both times."""
    steps: dict[int, list[int]] = {}
    for line in (out / f"samples_rank{rank}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] in steps:
            assert steps[rec["step"]] == rec["ids"], f"step {rec['step']} replayed with other samples"
        steps[rec["step"]] = rec["ids"]
    return steps


def load_final(out: Path, rank: int) -> dict[str, Any]:
    import torch

    return torch.load(out / f"final_rank{rank}.pt", weights_only=True)


def assert_states_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), f"parameter {key} differs"
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys()
    for pid in sa:
        for name in sa[pid]:
            assert torch.equal(torch.as_tensor(sa[pid][name]), torch.as_tensor(sb[pid][name])), f"optim {pid}.{name} differs"
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]


@contextmanager
def small_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "48k") mounted at mnt (0700) for disk-full tests; needs root."""
    if os.geteuid() != 0:
        raise AssertionError("mounting a tmpfs needs root (CI runs as root); run this test as root")
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


# ---- in-process, single-rank training (fast tests of save/resume logic) -----------------------

def make_parts(seed: int = 0, size: int = 64, batch: int = 4):
    """model, optimizer, scheduler, StatefulDataLoader (ResumableDistributedSampler), dataset."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptsup.hooks.sampler import ResumableDistributedSampler

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    gen = torch.Generator().manual_seed(seed + 1)
    data = [(i, torch.randn(8, generator=gen), torch.randn(1, generator=gen)) for i in range(size)]
    loader = StatefulDataLoader(data, batch_size=batch, sampler=ResumableDistributedSampler(data, num_replicas=1, rank=0, seed=seed))
    return model, opt, sched, loader


_ITERATORS: dict[int, Any] = {}


def train_steps(run, model, opt, sched, loader, start: int, stop: int) -> list[list[int]]:
    """Train steps [start, stop); the loader's iterator is kept across calls, as a real loop does."""
    import torch

    seen = []
    key = id(loader)
    if key not in _ITERATORS or _ITERATORS[key][0] is not loader:
        _ITERATORS[key] = (loader, iter(loader))
    for step in range(start, stop):
        try:
            ids, x, y = next(_ITERATORS[key][1])
        except StopIteration:
            _ITERATORS[key] = (loader, iter(loader))
            ids, x, y = next(_ITERATORS[key][1])
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        seen.append(ids.tolist())
        run.step_done(step, loss=loss.detach())
    return seen


def attach_parts(parts, ckdir: Path, **kw):
    import ckptsup

    model, opt, sched, loader = parts
    kw.setdefault("save_every_s", 3600)
    return ckptsup.attach(model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader,
                          checkpoint_dir=str(ckdir), **kw)


# ---- a stand-in for the agent's rank socket -------------------------------------------------

class FakeAgent:
    """Listens where the agent would, decodes every rank frame, sends commands."""

    def __init__(self, base: Path) -> None:
        self.dir = private_dir(base / "sock")
        self.path = self.dir / "ranks.sock"
        self.secret_file = base / "secret"
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
        self.secret = self.secret_file.read_bytes().strip()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        self.server.listen(8)
        self.frames: list[tuple[str, dict[str, Any]]] = []
        self.conns: list[socket.socket] = []
        self.ended = 0   # connections the other end closed
        self.seq = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            data = conn.recv(65536)
            if not data:
                self.ended += 1
                return
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                m, _, body = wire.decode(line, secret=self.secret)
                self.frames.append((m, body))

    def send(self, m: str, body: dict[str, Any], *, secret: bytes | None = None, seq: int | None = None) -> None:
        self.seq += 1
        frame = wire.encode(m, body, seq=self.seq if seq is None else seq, secret=secret or self.secret)
        for conn in self.conns:
            conn.sendall(frame)

    def env(self) -> dict[str, str]:
        return {"CKPTSUP_RANK_SOCKET": str(self.path), "CKPTSUP_SECRET_FILE": str(self.secret_file),
                "CKPTSUP_JOB_ID": "4242", "CKPTSUP_ATTEMPT": "1"}

    def of(self, m: str) -> list[dict[str, Any]]:
        return [body for name, body in list(self.frames) if name == m]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [b["record"] for b in self.of("event") if b["record"]["event"] == name]

    def wait_for(self, predicate, proc: subprocess.Popen, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        assert predicate(), f"rc={proc.poll()} frames={[m for m, _ in self.frames][-20:]}"

    def wait_ended(self, count: int, timeout: float = 20) -> None:
        """Until `count` connections ended: every frame their ranks sent has been read."""
        deadline = time.monotonic() + timeout
        while self.ended < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.ended >= count, f"{self.ended} of {count} connections ended; frames={[m for m, _ in self.frames][-20:]}"

    def of_rank(self, m: str, rank: int) -> list[dict[str, Any]]:
        return [body for body in self.of(m) if body.get("rank") == rank]

    def last_step(self) -> int:
        steps = [b["step"] for b in self.of("step")]
        return max(steps) if steps else -1

    def last_step_of(self, rank: int) -> int:
        steps = [b["step"] for b in self.of_rank("step", rank)]
        return max(steps) if steps else -1

    def close(self) -> None:
        self.server.close()
        for conn in self.conns:
            conn.close()


def capture_supervisor(monkeypatch) -> dict:
    """Replace the loop's Supervisor with a stand-in that records what `ckptsup launch` hands it
    (resolved config, job, placement) and exits DONE without running; returns that record."""
    from ckptsup.env import ExitStatus
    from ckptsup.supervisor.job import loop

    seen: dict = {}

    class Captured:
        def __init__(self, *, resolved, job, run_dir, placement):
            seen.update(resolved=resolved, job=job, placement=placement)

        def run(self):
            return ExitStatus.DONE

    monkeypatch.setattr(loop, "Supervisor", Captured)
    return seen
