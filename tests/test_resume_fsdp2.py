"""FSDP2 (fully_shard, sharded DTensor parameters and optimizer state) saves and resumes through
the same hooks: 3 steps, resume, 3 more equals 6 uninterrupted steps bit for bit (2 ranks, gloo)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from hooks_helpers import PY, base_env, free_port, private_dir

pytestmark = pytest.mark.torch

SCRIPT = Path(__file__).with_name("hooks_fsdp2_script.py")


def torchrun(ck: Path, steps: int, out: Path) -> None:
    argv = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(SCRIPT), str(ck), str(steps), str(out)]
    proc = subprocess.run(argv, env=base_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_fsdp2_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    base = private_dir(tmp_path)
    torchrun(base / "a", 6, base / "a.pt")
    torchrun(base / "b", 3, base / "b3.pt")
    torchrun(base / "b", 6, base / "b.pt")
    a, b = torch.load(base / "a.pt", weights_only=True), torch.load(base / "b.pt", weights_only=True)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for fqn, state in a["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optim"]["state"][fqn][name])), (fqn, name)
