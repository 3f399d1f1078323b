"""What the supervisor's dev-cluster tests share (tests/test_supervisor_slurm_*.py): the job config,
the submission of examples/train.py through the sbatch template, readers of the run's events, and the uninterrupted
local runs whose final parameters every faulted run must end with (docs/training.md §Bit-exact
resume). A test file takes a reference as a fixture, so only the files that need one run it, and
one pytest process runs each reference once: under `make test` at one worker the three files
share one run, under `-n 3` each worker runs it at most once."""
from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pytest import TempPathFactory

from ckptsup.events import read_events
from ckptsup.planning.accounting import account
from ckptsup.slurm.devconf import SPANNING

from run_helpers import CKPTSUP, Events, named, sbatch_submit

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
TRAIN_ARGS = ["--steps", "70", "--save-every-steps", "5", "--step-sleep-s", "0.1"]
SDC_ARGS = ["--steps", "40", "--save-every-steps", "5"]   # the SDC run (3 ranks) and its reference


def job_config(tmp: Path, extra_toml: str = "", supervisor_toml: str = "", adaptive: bool = False) -> Path:
    path = tmp / "job.toml"
    path.write_text("[supervisor]\nhang_min_s = 10.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n" + supervisor_toml +
                    f"[checkpoint]\nadaptive_interval = {str(adaptive).lower()}\nkeep_daily_days = 0\ntest_load_every = 0\n"
                    f"[slurm]\nspare_partition = \"{SPANNING}\"\n" + extra_toml)
    return path


_UNINTERRUPTED: dict[str, Path] = {}   # name -> out folder of a reference run this process has made


def uninterrupted_run(tmp_path_factory: TempPathFactory, name: str, nproc: int, args: list[str]) -> Path:
    """The out folder of an uninterrupted local run of examples/train.py (`nproc` gloo ranks),
    made once per pytest process and kept for the session."""
    if name not in _UNINTERRUPTED:
        tmp = tmp_path_factory.mktemp(name)
        proc = subprocess.run([*CKPTSUP, "launch", "--nproc-per-node", str(nproc), "--config", str(job_config(tmp)),
                               "--run-dir", str(tmp / "run"), str(TRAIN), *args, "--out", str(tmp / "out")],
                              capture_output=True, text=True, timeout=300, cwd=tmp)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _UNINTERRUPTED[name] = tmp / "out"
    return _UNINTERRUPTED[name]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: TempPathFactory) -> str:
    """Final parameters of the uninterrupted run: 2 gloo ranks, local mode, computed once (without
    the step sleep: it changes no parameter, and 70 x 0.1 s is all the faulted runs need it for)."""
    out = uninterrupted_run(tmp_path_factory, "slurm-reference", 2, [*TRAIN_ARGS, "--step-sleep-s", "0"])
    return json.loads((out / "final.json").read_text())["params_sha256"]


@pytest.fixture(scope="module")
def reference_3_ranks(tmp_path_factory: TempPathFactory) -> dict:
    """Final parameters of the uninterrupted 3-rank run (local mode; the step sleep changes nothing)."""
    out = uninterrupted_run(tmp_path_factory, "sdc-reference", 3, SDC_ARGS)
    return torch_load(out / "final_rank0.pt")["model"]


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def submit(tmp: Path, *, nodes: int, spares: int, partition: str | None = None,
           extra: tuple[str, ...] = (), extra_toml: str = "", supervisor_toml: str = "",
           adaptive: bool = False, flags: tuple[str, ...] = ()) -> tuple[str, Path, Path]:
    out = tmp / "out"
    config = job_config(tmp, extra_toml, supervisor_toml, adaptive)
    job, run = sbatch_submit(tmp, config, TRAIN, *TRAIN_ARGS, "--out", str(out), *extra, nodes=nodes, spares=spares,
                             partition=partition, flags=flags)
    return job, run, out


def ts(event: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(event["ts"]).timestamp()


def committed(run: Path, step: int) -> bool:
    return any(e.get("step", -1) >= step for e in named(read_events(run), "checkpoint_committed"))


def active_nodes(run: Path) -> list[str]:
    return named(read_events(run), "launch")[-1]["nodes"]


def assert_goodput_accounted(events: Events) -> Any:
    """Issue 5 on a real faulted dev-cluster run: badput categories plus useful time equal the
    paid device-time within 1%, and the node death's detection is charged."""
    acc = account(events)
    total = acc.useful_device_s + sum(acc.badput_device_s.values())
    assert acc.paid_device_s > 0 and acc.useful_device_s > 0
    assert abs(total - acc.paid_device_s) <= 0.01 * acc.paid_device_s
    assert acc.failures.get("node_down") == 1 and acc.end_reason.value == "run_complete"
    assert acc.badput_device_s["detection"] > 0
    return acc


def finished(dev_cluster: Any, job: str) -> bool:
    state = dev_cluster.job_state(job)
    return state is None or state.finished

