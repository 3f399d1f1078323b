"""What a warm restart pays per rank between the crash and the first step (issue 38 part 2,
docs/supervisor.md §Warm restarts): torchrun's warm worker is rankside/warm_proxy.py run as a file
under `python -S` — no site, no package, standard library only — and still hands its rank to the
warm interpreter or starts it cold; the zygote pre-imports what a DDP rank would otherwise import
after every restart; a kill with no grace signals the warm ranks before it waits on torchrun."""
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckptsup import env
from ckptsup.rankside import warm_proxy
from ckptsup.supervisor.node.agent import WARM_PROXY, Agent
from ckptsup.supervisor.node.forked import ForkedChild
from ckptsup.supervisor.node.warm_pool import WarmPool

SCRIPT = """
import sys
print("no_site", sys.flags.no_site, "torch", "torch" in sys.modules, "argv", sys.argv[1:], flush=True)
sys.exit(int(sys.argv[1]))
"""


def entrypoint(*, module: bool) -> list[str]:
    spec = SimpleNamespace(module=module, script="train.py", no_python=False)
    return Agent._entrypoint(SimpleNamespace(spec=spec), True)   # type: ignore[arg-type]


def test_the_agents_warm_worker_is_the_proxy_file_under_dash_S() -> None:
    assert entrypoint(module=False) == ["--no-python", sys.executable, "-S", WARM_PROXY, "train.py"]
    assert entrypoint(module=True) == ["--no-python", sys.executable, "-S", WARM_PROXY, env.RANK_MODULE_FLAG,
                                       "train.py"]
    assert Path(WARM_PROXY).is_file() and Path(WARM_PROXY).samefile(warm_proxy.__file__)


def test_the_proxy_keeps_the_names_of_env() -> None:
    assert (warm_proxy.WARM_DIR, warm_proxy.RANK_MODULE_FLAG) == (env.WARM_DIR, env.RANK_MODULE_FLAG)
    for module in (False, True):
        assert warm_proxy.cold_rank_argv("py", ["s.py", "-x"], module=module) == \
            env.cold_rank_argv("py", ["s.py", "-x"], module=module)
    for args in ([env.RANK_MODULE_FLAG, "pkg.mod", "a"], ["s.py", env.RANK_MODULE_FLAG], []):
        assert warm_proxy.split_module_flag(list(args)) == env.split_module_flag(list(args))


def test_the_proxy_file_loads_only_the_standard_library_under_dash_S() -> None:
    probe = (f"import json, runpy, sys; runpy.run_path({WARM_PROXY!r}, run_name='probe'); "
             "print(json.dumps({m: getattr(mod, '__file__', None) for m, mod in sys.modules.items()}))")
    out = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    modules = json.loads(out.stdout)
    assert "site" not in modules and not any(m == "ckptsup" or m.startswith("ckptsup.") for m in modules)
    purelib = sysconfig.get_paths()["purelib"]
    assert not [m for m, f in modules.items() if f and f.startswith(purelib)]


def run_proxy(tmp_path: Path, exit_code: str, *, warm_dir: Path | None) -> subprocess.CompletedProcess:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    environ = {k: v for k, v in os.environ.items() if k != env.WARM_DIR}
    environ.update({"RANK": "0", "LOCAL_RANK": "0", **({env.WARM_DIR: str(warm_dir)} if warm_dir else {})})
    return subprocess.run(entrypoint(module=False)[1:-1] + [str(script), exit_code], env=environ, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_without_a_warm_interpreter_the_proxy_under_dash_S_starts_the_rank_cold_with_site(tmp_path) -> None:
    done = run_proxy(tmp_path, "4", warm_dir=None)
    assert done.returncode == 4, done.stderr
    assert "no_site 0 torch False argv ['4']" in done.stdout   # a whole interpreter again: site is back


@pytest.mark.integration
def test_under_dash_S_the_proxy_hands_its_rank_to_the_warm_interpreter(tmp_path) -> None:
    from ckptsup.supervisor.node.zygote import Zygote

    zygote = Zygote.start(env=dict(os.environ), cwd=str(tmp_path))
    assert zygote is not None
    directory = tmp_path / "sock"
    directory.mkdir(mode=0o700)
    pool = WarmPool(directory=directory, size=1, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 120
        while not zygote.ready():
            assert time.monotonic() < deadline, "the zygote never got ready"
            time.sleep(0.05)
        pool.start(zygote)
        while not pool.ready():
            assert time.monotonic() < deadline, "the warm interpreter never got ready"
            time.sleep(0.05)
        assert pool.hand_out()
        done = run_proxy(tmp_path, "5", warm_dir=pool.in_use_dir)
        assert done.returncode == 5, done.stderr
        assert "no_site 0 torch True argv ['5']" in done.stdout   # the warm interpreter ran it
        assert pool.in_use[0].wait(timeout=30) == 5
    finally:
        pool.close()
        zygote.close()


@pytest.mark.integration
def test_after_the_zygotes_preimports_a_ddp_model_imports_nothing_of_dynamo() -> None:
    """DistributedDataParallel's constructor imports torch._dynamo (~0.6 s): a warm rank paid it
    after every restart, between its process group and its hello, until the zygote imported it."""
    probe = """
import os, sys
from ckptsup.rankside import warm_rank, zygote
warm_rank.preimport(zygote.PREIMPORTS)
before = set(sys.modules)
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
print(sorted(m for m in set(sys.modules) - before if m.startswith("torch._dynamo")))
dist.destroy_process_group()
"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", probe, str(port)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_signal_in_use_kills_the_launchs_warm_ranks_without_waiting(tmp_path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    pool = WarmPool(directory=tmp_path, size=2)
    pool.in_use = [ForkedChild(p.pid) for p in procs]
    try:
        pool.signal_in_use(signal.SIGKILL)
        assert [child.wait(timeout=30) for child in pool.in_use] == [-signal.SIGKILL] * 2
        pool.signal_in_use(signal.SIGKILL)   # already gone: nothing to signal, nothing raised
    finally:
        for p in procs:
            p.kill()
