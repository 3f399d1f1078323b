"""One rank of gpu_check's NCCL part, started with the environment a rank under ckptsup gets
(supervisor/job/nccl.py nccl_env + RANK/WORLD_SIZE/MASTER_*): ckptsup.init_process_group (NCCL on a
GPU, gloo on the CPU), one all-reduce on the device, the group's timeout read back from the live
backend before and after the hooks move it to the steady value; prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time

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
    # the dump the supervisor asks for before it kills hung ranks (DUMP_FR -> agent_socket)
    from ckptsup.hooks.agent_socket import dump_flight_recorder

    t0 = time.perf_counter()
    try:
        dumped = dump_flight_recorder(os.environ.get("CKPTSUP_FR_DUMP_DIR", "."), dist.get_rank())
        out["fr_dump"] = {"path": None if dumped is None else str(dumped), "s": round(time.perf_counter() - t0, 4),
                          "bytes": None if dumped is None else dumped.stat().st_size,
                          "names_all_reduce": dumped is not None and b"all_reduce" in dumped.read_bytes().lower().replace(b"allreduce", b"all_reduce")}
    except Exception as err:  # noqa: BLE001 - reported as a figure, the part goes on
        out["fr_dump"] = {"error": f"{type(err).__name__}: {err}"[:300]}
    import torch._C._distributed_c10d as c10d

    out["fr_dump"]["recorders"] = {name: len(getattr(c10d, name)()) for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json")
                                   if hasattr(c10d, name)}
    out["env"] = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL_", "TORCH_FR_", "CKPTSUP_COLLECTIVE"))}
    dist.destroy_process_group()
    print("GPU_CHECK_NCCL " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
