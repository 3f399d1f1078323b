"""One rank of gpu_check's NCCL part, started with the environment a rank under ckptsup gets
(supervisor/nccl.py nccl_env + RANK/WORLD_SIZE/MASTER_*): ckptsup.init_process_group (NCCL on a
GPU, gloo on the CPU), one all-reduce on the device, the group's timeout read back from the live
backend before and after the hooks move it to the steady value; prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import ckptsup
from ckptsup.hooks.process_group import set_steady_timeout


def live_timeout_s(device: torch.device) -> float | None:
    """The timeout the live backend holds (its options), None when this torch hides it."""
    try:
        backend = dist.group.WORLD._get_backend(device)
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def main() -> int:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ckptsup.init_process_group()
    out: dict = {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                 "init_timeout_s": live_timeout_s(device)}
    t = torch.ones(4, device=device)
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize()
    out["all_reduce_ok"] = t.tolist() == [1.0] * 4
    out["moved_to_steady"] = set_steady_timeout()
    out["steady_timeout_s"] = live_timeout_s(device)
    out["env"] = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL_", "TORCH_FR_", "CKPTSUP_COLLECTIVE"))}
    dist.destroy_process_group()
    print("GPU_CHECK_NCCL " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
