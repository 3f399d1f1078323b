"""The parts of bench/gpu_check.py that measure state on the device: the async save, the restore,
the memory tier. Each takes the Context and returns {"figures", "checks", "targets",
"skipped_steps"}; the process-level parts (restart, GPU health, NCCL) are in gpu_parts_proc.py.

Through ckptsup's own APIs: ckptsup.attach / Run.save / Run.resume (the writer's Stager, the
verifying reader), MemorySaver / MemoryClient against a real MemoryServer, TrainingState.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from gpu_check import Context, Part, Skip

GIB = 1 << 30
TENSOR_BYTES = 256 << 20      # parameters in 256 MiB tensors (DCP writes them as items)
QUIET = {"keep_daily_days": 0, "test_load_every": 0, "keep_last": 10}   # housekeeping off: the save path only


def pick_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _clear_ckptsup_env() -> None:
    # a run of its own, not a rank of some supervisor that happens to be around
    for key in [k for k in os.environ if k.startswith("CKPTSUP_")]:
        del os.environ[key]


# ---- env -------------------------------------------------------------------------------------------

def part_env(ctx: Context) -> dict[str, Any]:
    import torch

    import ckptsup

    figures: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                               "ckptsup": ckptsup.__version__, "ckptsup_from": str(Path(ckptsup.__file__).parent),
                               "device": ctx.device, "cuda": torch.version.cuda or "none",
                               "cpus": os.cpu_count()}
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        figures.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                       gpus_visible=torch.cuda.device_count(), sm_count=props.multi_processor_count)
        try:
            figures["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:   # a figure, not a prerequisite
            figures["nccl"] = f"unknown ({type(err).__name__})"
    # every module that imports torch on a rank must import on this torch (2.11 on the device)
    import importlib

    failed = {}
    for mod in ("ckptsup.hooks.session", "ckptsup.hooks.writer", "ckptsup.hooks.loader", "ckptsup.hooks.memory_tier",
                "ckptsup.hooks.sampler", "ckptsup.supervisor.job.loop", "ckptsup.rankside.warm_rank"):
        try:
            importlib.import_module(mod)
        except Exception as err:   # recorded: the parts that need it then fail with the same cause
            failed[mod] = f"{type(err).__name__}: {err}"[:300]
    figures["import_failures"] = failed
    return {"figures": figures, "checks": {"ckptsup_imports_on_this_torch": not failed}}


# ---- the state on the device ------------------------------------------------------------------------

def build_state(total_bytes: float, device: str) -> tuple[Any, Any, int]:
    """A model whose fp32 parameters are a third of `total_bytes`, AdamW with its two moments
    materialised (one step on zero gradients): (model, optimizer, state bytes)."""
    import torch

    params = max(int(total_bytes / 3), 4096)
    chunk = min(TENSOR_BYTES, params)
    n = max(1, params // chunk)
    model = torch.nn.Module()
    model.blocks = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(chunk // 4, device=device)) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    _sync(device)
    return model, opt, 3 * n * chunk


def device_tensors(model: Any, opt: Any) -> list[Any]:
    import torch

    out = [p for p in model.parameters()]
    for state in opt.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return out


def snapshot(model: Any, opt: Any) -> list[Any]:
    return [t.detach().clone() for t in device_tensors(model, opt)]


def same(tensors: list[Any], refs: list[Any]) -> bool:
    import torch

    return len(tensors) == len(refs) and all(torch.equal(a, b) for a, b in zip(tensors, refs))


def perturb(model: Any, opt: Any) -> None:
    import torch

    with torch.no_grad():
        for t in device_tensors(model, opt):
            t.add_(1.0)


class AllocCounter:
    """Counts the Stager's host-buffer allocations (torch's _create_cpu_state_dict, which the
    writer calls only when it has no reusable buffers) for the duration of a `with`."""

    def __enter__(self) -> "AllocCounter":
        import torch.distributed._state_dict_utils as sdu

        self.module, self.real, self.calls = sdu, sdu._create_cpu_state_dict, 0

        def counted(*a: Any, **k: Any) -> Any:
            self.calls += 1
            return self.real(*a, **k)

        sdu._create_cpu_state_dict = counted
        return self

    def __exit__(self, *exc: object) -> None:
        self.module._create_cpu_state_dict = self.real


def host_alloc_stats() -> dict[str, Any]:
    """torch's caching host allocator counters (pinned blocks it made), when this torch has them."""
    import torch

    getter = getattr(torch.cuda, "host_memory_stats", None)
    if getter is None or not torch.cuda.is_available():
        return {}
    try:
        stats = getter()
    except Exception:   # counters are a nicety; their absence is recorded as {}
        return {}
    return {k: v for k, v in stats.items() if isinstance(v, int) and ("alloc" in k or "segment" in k)}


def staged_ptrs(run: Any) -> list[int]:
    import torch

    from ckptsup.hooks.writer import _leaves

    buffers = run.writer.stager._buffers or {}
    return [t.data_ptr() for t in _leaves(buffers) if isinstance(t, torch.Tensor)]


def staged_pinned(run: Any) -> bool | None:
    import torch

    from ckptsup.hooks.writer import _leaves

    leaves = [t for t in _leaves(run.writer.stager._buffers or {}) if isinstance(t, torch.Tensor) and t.numel() > 1]
    return all(t.is_pinned() for t in leaves) if leaves else None


def raw_d2h(tensors: list[Any], device: str) -> tuple[float, Any]:
    """Seconds of copy_(non_blocking=True) of every tensor into one pinned host buffer of the same
    size (the raw device-to-host rate the Stager is compared with), and that buffer."""
    import torch

    total = sum(t.numel() * t.element_size() for t in tensors)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device == "cuda")
    views, at = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        views.append(host[at:at + size].view(t.dtype).view(t.shape))
        at += size
    for v, t in zip(views, tensors):   # a warm-up pass: page faults of the fresh buffer are not the link's
        v.copy_(t, non_blocking=True)
    _sync(device)
    t0 = time.perf_counter()
    for v, t in zip(views, tensors):
        v.copy_(t, non_blocking=True)
    _sync(device)
    return time.perf_counter() - t0, (host, views)


def raw_to_cpu(tensors: list[Any], device: str) -> float:
    """The same bytes through the plain `tensor.to("cpu", non_blocking=True)` (a fresh pinned
    tensor per call), one tensor at a time, for reference."""
    t0 = time.perf_counter()
    for t in tensors:
        out = t.to("cpu", non_blocking=True)
        _sync(device)
        del out
    return time.perf_counter() - t0


def part_async_save(ctx: Context) -> dict[str, Any]:
    import torch

    import ckptsup

    _clear_ckptsup_env()
    figures: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    want = ctx.args.state_gb * 1e9
    if ctx.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        # the state, its bit-exact reference copy for the restore part and the loader's headroom
        cap = 0.3 * free
        if want > cap:
            skipped["full_size"] = f"{want / 1e9:.1f} GB asked, {free / 1e9:.1f} GB free: ran at {cap / 1e9:.1f} GB"
            want = cap
    t0 = time.perf_counter()
    model, opt, nbytes = build_state(want, ctx.device)
    figures.update(state_bytes=nbytes, state_gb=round(nbytes / 1e9, 3), build_s=round(time.perf_counter() - t0, 3))
    ckdir = ctx.work / "ckpt"
    run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=str(ckdir), save_every_s=600000, jitter_s=0, **QUIET)
    ctx.shared.update(model=model, opt=opt, ckdir=ckdir, nbytes=nbytes)
    checks: dict[str, bool] = {}
    targets: dict[str, bool] = {}   # speed: meaningful on a GPU only (the dry run records, never claims)
    try:
        with AllocCounter() as allocs:
            before = host_alloc_stats()
            run.next_step = 1
            blocking = run.save(reason="gpu-check", blocking=True)
            if blocking is None or not blocking.ok:
                raise RuntimeError(f"the blocking save failed: {getattr(blocking, 'reason', 'no result')}")
            after_first = host_alloc_stats()
            figures.update(blocking_save_s=round(blocking.total_s, 4), blocking_stall_s=round(blocking.stall_s, 4),
                           blocking_write_s=round(blocking.write_s, 4), checkpoint_bytes=blocking.bytes)
            ptrs_first = staged_ptrs(run)
            stalls, writes = [], []
            try:
                # two async saves: both reuse the blocking save's buffers; the last is the restore part's
                for step in (2, 3):
                    ctx.need(1.5 * blocking.total_s + 5, f"async save of step {step}")
                    if step == 3:   # what the restore part must get back, bit for bit
                        ctx.shared["refs"] = snapshot(model, opt)
                        ctx.shared["cuda_rng"] = torch.cuda.get_rng_state() if ctx.device == "cuda" else None
                        ctx.shared["cpu_rng"] = torch.get_rng_state()
                    run.next_step = step
                    t0 = time.perf_counter()
                    run.save(reason="gpu-check", blocking=False)
                    stalls.append(time.perf_counter() - t0)
                    result = run.writer.wait()
                    if result is None or not result.ok:
                        raise RuntimeError(f"async save of step {step} failed: {getattr(result, 'reason', 'no result')}")
                    writes.append(result.write_s)
                ctx.shared["saved_step"] = 3
            except Skip as why:   # the figures so far stay; the restore part then says why it cannot run
                ctx.shared.pop("refs", None)
                skipped["async saves"] = str(why)
            after = host_alloc_stats()
            reused = staged_ptrs(run) == ptrs_first and bool(ptrs_first)
            later = {k: after[k] - after_first.get(k, 0) for k in after if after[k] != after_first.get(k, 0)}
            figures.update(async_stall_s=[round(x, 4) for x in stalls], async_write_s=[round(w, 4) for w in writes],
                           stager_allocations=allocs.calls, staging_pinned=staged_pinned(run),
                           host_alloc_first_save={k: after_first[k] - before.get(k, 0) for k in after_first
                                                  if after_first[k] != before.get(k, 0)},
                           host_alloc_later_saves=later)
            if after:   # torch's pinned (caching host) allocator: nothing new after the first save
                checks["no pinned allocation after the first save (host_memory_stats)"] = not any(
                    v > 0 for k, v in later.items() if k in ("allocations.allocated", "num_host_alloc"))
            checks["staging buffers reused (one allocation, same pointers)"] = allocs.calls == 1 and reused
            if ctx.device == "cuda":
                checks["staging buffers pinned"] = bool(figures["staging_pinned"])
            if stalls:
                figures["stall_vs_blocking"] = round(stalls[-1] / blocking.total_s, 4)
                targets["stall_vs_blocking <= 0.1"] = stalls[-1] / blocking.total_s <= 0.1
        for old in ("step_1", "step_2"):   # the disk holds the restore part's checkpoint only
            shutil.rmtree(ckdir / old, ignore_errors=True)
        try:
            raw_rates(ctx, run, model, opt, figures, targets, skipped)
        except Skip as why:
            skipped["raw device-to-host copies"] = str(why)
    finally:
        run.close(final_save=False)
    return {"figures": figures, "checks": checks, "skipped_steps": skipped, "targets": targets}


def raw_rates(ctx: Context, run: Any, model: Any, opt: Any, figures: dict[str, Any], targets: dict[str, bool],
              skipped: dict[str, str]) -> None:
    """The Stager's device-to-host copy alone (into its reused buffers) vs a raw pinned copy_ of
    the same tensors, and the plain .to("cpu", non_blocking=True) for reference."""
    tensors = device_tensors(model, opt)
    moved = sum(t.numel() * t.element_size() for t in tensors)
    ctx.need(10 + 3 * moved / 5e9, "raw device-to-host copies")
    raw_s, host = raw_d2h(tensors, ctx.device)
    ctx.shared["host"] = host
    t0 = time.perf_counter()
    run.writer.stager.stage(run.state.model_optim_state())
    stage_s = time.perf_counter() - t0
    figures.update(stager_d2h_GBps=round(moved / stage_s / 1e9, 3), raw_pinned_d2h_GBps=round(moved / raw_s / 1e9, 3),
                   stager_vs_raw=round(raw_s / stage_s, 4))
    targets["stager D2H >= 0.8 x raw pinned copy_"] = raw_s / stage_s >= 0.8
    if ctx.left() > 10 + 3 * raw_s:
        to_cpu_s = raw_to_cpu(tensors, ctx.device)
        figures.update(raw_to_cpu_GBps=round(moved / to_cpu_s / 1e9, 3))
    else:
        skipped["raw_to_cpu"] = "budget"


def free_shared(ctx: Context) -> None:
    """The earlier parts' state off the GPU and out of pinned memory before a part of its own."""
    import gc

    import torch

    ctx.shared.clear()
    gc.collect()
    if ctx.device == "cuda":
        torch.cuda.empty_cache()


def part_restore(ctx: Context) -> dict[str, Any]:
    import torch

    import ckptsup

    _clear_ckptsup_env()
    sh = ctx.shared
    model, opt = sh["model"], sh["opt"]
    if "refs" not in sh:
        raise Skip("the async-save part did not reach its last save")
    perturb(model, opt)
    if ctx.device == "cuda":
        torch.cuda.manual_seed(12345)   # the live CUDA generator moves away from the saved one
        torch.randn(16, device="cuda")
    torch.manual_seed(54321)
    checks: dict[str, bool] = {"perturbed before the load": not same(device_tensors(model, opt), sh["refs"])}
    run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=str(sh["ckdir"]), save_every_s=600000, **QUIET)
    try:
        _sync(ctx.device)
        t0 = time.perf_counter()
        step = run.resume()
        _sync(ctx.device)
        load_s = time.perf_counter() - t0
    finally:
        run.close(final_save=False)
    figures: dict[str, Any] = {"resumed_step": step, "load_s": round(load_s, 4),
                               "load_GBps": round(sh["nbytes"] / load_s / 1e9, 3), "load_tiers": run.load_tiers}
    checks["resumed the step saved last"] = step == sh["saved_step"]
    checks["parameters and optimizer state bit-exact"] = same(device_tensors(model, opt), sh["refs"])
    checks["CPU RNG restored"] = torch.equal(torch.get_rng_state(), sh["cpu_rng"])
    if ctx.device == "cuda":
        checks["CUDA RNG restored"] = torch.equal(torch.cuda.get_rng_state(), sh["cuda_rng"])
        checks["parameters on the GPU after the load"] = all(t.is_cuda for t in device_tensors(model, opt))
    host = sh.get("host")
    if host is not None:   # raw host-to-device of the same bytes from the pinned buffer
        _, views = host
        targets = device_tensors(model, opt)
        _sync(ctx.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            for t, v in zip(targets, views):
                t.copy_(v, non_blocking=True)
        _sync(ctx.device)
        h2d_s = time.perf_counter() - t0
        moved = sum(v.numel() * v.element_size() for v in views)
        figures.update(raw_pinned_h2d_GBps=round(moved / h2d_s / 1e9, 3), load_vs_raw_h2d=round(h2d_s / load_s, 4))
    return {"figures": figures, "checks": checks,
            "notes": "load_s = resume(): manifest checks, every item hashed as read, DCP load, copy to the device; "
                     "the files may be in the page cache (written just before)"}


# ---- the memory tier, from device memory ------------------------------------------------------------

def part_memory_tier(ctx: Context) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptsup.hooks.loader import _fresh_copy
    from ckptsup.hooks.memory_tier import BundleReader, MemoryClient, MemorySaver, memory_checkpoint_id
    from ckptsup.hooks.reader import safe_load_planner
    from ckptsup.hooks.state import TrainingState
    from ckptsup.supervisor.node.memory_store import MemoryServer, MemoryStore, unix_listener

    free_shared(ctx)
    secret_hex = os.urandom(32).hex()
    secret = ctx.work / "memory-secret"
    secret.write_text(secret_hex)
    secret.chmod(0o600)
    sock_dir = ctx.work / "mem"
    sock_dir.mkdir(mode=0o700, exist_ok=True)
    # the agent's store and server, in this process (its own threads), as an agent holds them
    server = MemoryServer(unix_listener(str(sock_dir / "agent.sock")), secret=secret_hex.encode(),
                          store=MemoryStore(keep=2)).start()
    figures: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    try:
        model, opt, nbytes = build_state(ctx.args.memory_gb * 1e9, ctx.device)
        state = TrainingState(model=model, optimizer=opt, rank=0, world_size=1)
        client = MemoryClient(socket_path=str(sock_dir / "agent.sock"), secret_file=str(secret), rank=0)
        results: list[Any] = []
        saver = MemorySaver(client, algorithm="xxh3-128", max_bytes=0, on_result=results.append)
        figures["state_bytes"] = nbytes
        stalls = []
        refs = None
        for step in (1, 2):   # the second reuses the first's staging buffers: the steady stall
            ctx.need(15, f"memory save of step {step}")
            if step == 2:
                refs = snapshot(model, opt)
            t0 = time.perf_counter()
            saver.save(step=step, checkpoint_id=memory_checkpoint_id(job_id="gpu", attempt=0, epoch=0, step=step),
                       device_state=state.model_optim_state(), side_state={}, extra={"rank": 0, "world_size": 1})
            stalls.append(time.perf_counter() - t0)
            saver.wait()
        saver.close()
        ok = [r for r in results if r.ok]
        if len(ok) != 2:
            raise RuntimeError(f"memory saves failed: {[r.reason for r in results if not r.ok]}")
        figures.update(memory_stall_s=[round(s, 4) for s in stalls], memory_write_s=[round(r.write_s, 4) for r in ok],
                       bundle_bytes=ok[-1].bytes, stall_vs_write=round(stalls[-1] / ok[-1].write_s, 4))
        perturb(model, opt)
        ctx.need(15, "restore from the agent")
        _sync(ctx.device)
        t0 = time.perf_counter()
        bundle = client.get(2)
        fetched = time.perf_counter() - t0
        reader = BundleReader(bundle)
        reader.read_metadata()
        like = state.model_optim_state()
        targets = _fresh_copy(like)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(targets, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, opt, model_state_dict=targets["model"], optim_state_dict=targets["optim"])
        _sync(ctx.device)
        restore_s = time.perf_counter() - t0
        figures.update(fetch_s=round(fetched, 4), restore_s=round(restore_s, 4),
                       restore_GBps=round(nbytes / restore_s / 1e9, 3))
        checks["restored from the agent bit-exact"] = refs is not None and same(device_tensors(model, opt), refs)
        if ctx.device == "cuda":
            checks["restored onto the GPU"] = all(t.is_cuda for t in device_tensors(model, opt))
    finally:
        server.close()
    return {"figures": figures, "checks": checks,
            "notes": "stall = staging into reused (pinned on a GPU) host buffers; restore = fetch from the agent's store over "
                     "its Unix socket + verify every item + DCP load + copy onto the device"}


def part_fingerprint(ctx: Context) -> dict[str, Any]:
    """Replica fingerprints (docs/sdc.md) on the device: GB/s of `fingerprint(state_tensors(...))`
    over parameters + AdamW state, beside a plain read of the same bytes (a sum per tensor)."""
    import torch

    from ckptsup.hooks.fingerprint import fingerprint, state_tensors

    gib = 0.01 if ctx.dry_run else 1.0
    per = int(gib * (1 << 30) / 3 / 4)
    rows = max(1, per // 4096)
    model = torch.nn.Linear(4096, rows, bias=False).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters())
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    tensors = list(state_tensors(model, opt))
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)

    def timed(fn: Callable[[], Any], rounds: int) -> tuple[float, Any]:
        fn()
        _sync(ctx.device)
        best, out = float("inf"), None
        for _ in range(rounds):
            t0 = time.perf_counter()
            out = fn()
            _sync(ctx.device)
            best = min(best, time.perf_counter() - t0)
        return best, out

    rounds = 3 if ctx.dry_run else 5
    fp_s, lanes = timed(lambda: fingerprint(tensors), rounds)
    read_s, _ = timed(lambda: [t.float().sum().item() for _, t in tensors], rounds)
    again = fingerprint(tensors)
    with torch.no_grad():
        model.weight.view(-1)[12345 % model.weight.numel()] += 1.0
    flipped = fingerprint(tensors)
    figures = {"state_bytes": nbytes, "fingerprint_s": round(fp_s, 5), "fingerprint_GBps": round(nbytes / fp_s / 1e9, 2),
               "plain_read_GBps": round(nbytes / read_s / 1e9, 2), "fingerprint_vs_read": round(read_s / fp_s, 3)}
    checks = {"fingerprint repeatable": list(lanes) == list(again), "one changed parameter changes it": list(flipped) != list(lanes)}
    return {"figures": figures, "checks": checks,
            "notes": "best of the rounds; the read baseline is a float32 sum per tensor (one HBM read)"}


def _parts() -> list[Part]:
    from gpu_parts_proc import part_gpu_health, part_nccl, part_restart

    return [Part("env", 0.02, 0, part_env),
            Part("async_save", 0.30, 30, part_async_save),
            Part("restore", 0.12, 15, part_restore, needs=("async_save",)),
            Part("memory_tier", 0.12, 20, part_memory_tier),
            Part("restart", 0.25, 45, part_restart),
            Part("gpu_health", 0.06, 5, part_gpu_health),
            Part("nccl", 0.08, 15, part_nccl),
            Part("fingerprint", 0.05, 10, part_fingerprint)]


PARTS = _parts()
