"""Checkpoint save and restore throughput against the raw sequential bandwidth of the same
directory (dd, measured in the same run), and the stall of an async save against the duration of
a sync save of the same state.

    python bench/bench_save.py [--state-mb 768] [--dir DIR] [--repeats 3]

- save: a blocking ckptsup save (staging copy + DCP write + fsync + per-file/per-item hashing +
  manifest + rename) vs `dd if=<random bytes in RAM> of=DIR/dd.bin bs=8M conv=fsync` of the same
  byte count (bench_hash's baseline).
- restore: resume() (pre-load checks, .metadata hash, every item hashed as it is read, apply) vs
  `dd if=DIR/dd.bin of=/dev/null bs=8M`. Before every read, both the dd file and the checkpoint
  are evicted from the page cache (posix_fadvise DONTNEED), so both read from the device.
- stall: an async save's stall (the copy into reused host buffers; the first save allocates them,
  so it is measured on the second) over a sync save's duration.
Targets: save and restore >= 0.8 of dd; stall/sync <= 0.1 on a GPU. On CPU the "device" copy is a
host memcpy, so the stall is memcpy time over memcpy + write + fsync + hash: see the printed note.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptsup  # noqa: E402
from bench_hash import dd_write_read, evict, make_random_source  # noqa: E402  (same dd baseline as the hash bench)


class Big(torch.nn.Module):
    def __init__(self, mb: int) -> None:
        super().__init__()
        n = max(1, mb // 64)
        self.blocks = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(64 * 1024 * 1024 // 4 // 1024, 1024)) for _ in range(n)])


def evict_tree(path: Path) -> None:
    for f in (p for p in path.rglob("*") if p.is_file()):
        evict(f)


def build(state_mb: int):
    # AdamW state doubles the parameters: params take a third of the state
    model = Big(max(64, state_mb // 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-mb", type=int, default=768)
    ap.add_argument("--dir", default=None, help="directory to measure (default: a temp dir under /tmp)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckptsup-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o700)
    model, opt = build(args.state_mb)
    for key in [k for k in os.environ if k.startswith("CKPTSUP_")]:
        del os.environ[key]

    saves, restores, dd_w, dd_r, stalls, syncs = [], [], [], [], [], []
    source: Path | None = None
    nbytes = 0
    for i in range(args.repeats):
        ck = base / f"ck{i}"
        # housekeeping off (no retention/test loads competing for the disk): this measures the save path
        quiet = {"keep_daily_days": 0, "test_load_every": 0, "keep_last": 10}
        run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=str(ck), save_every_s=1e9, jitter_s=0, **quiet)
        # sync save (measures the whole path); then two async saves: the second shows the steady stall
        run.next_step = 1
        result = run.save(reason="bench", blocking=True)
        assert result is not None and result.ok, result
        nbytes = result.bytes
        syncs.append(result.total_s)
        saves.append(result.bytes / result.total_s)
        for step in (2, 3):
            run.next_step = step
            t0 = time.perf_counter()
            run.save(reason="bench", blocking=False)
            stall = time.perf_counter() - t0
            run.writer.wait()
        stalls.append(stall)
        run.close(final_save=False)
        # dd of the same size, same directory, random bytes (zeros would flatter some disks)
        if source is None:
            source = make_random_source(nbytes >> 20)
        write_gbps, read_gbps = dd_write_read(base, nbytes >> 20, source)
        dd_w.append(write_gbps * 1e9)
        dd_r.append(read_gbps * 1e9)
        # restore the sync checkpoint only
        for extra in ("step_2", "step_3"):
            shutil.rmtree(ck / extra)
        evict_tree(ck)
        run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=str(ck), save_every_s=1e9, **quiet)
        t0 = time.perf_counter()
        assert run.resume() == 1
        restores.append(nbytes / (time.perf_counter() - t0))
        run.close(final_save=False)
        shutil.rmtree(ck)

    med = statistics.median
    report = {
        "state_bytes": nbytes, "dir": str(base), "repeats": args.repeats,
        "save_GBps": med(saves) / 1e9, "dd_write_GBps": med(dd_w) / 1e9, "save_vs_dd": med(saves) / med(dd_w),
        "restore_GBps": med(restores) / 1e9, "dd_read_GBps": med(dd_r) / 1e9, "restore_vs_dd": med(restores) / med(dd_r),
        "async_stall_s": med(stalls), "sync_save_s": med(syncs), "stall_vs_sync": med(stalls) / med(syncs),
        "device": "cpu",
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"state {nbytes / 1e6:.0f} MB in {base}, median of {args.repeats}")
        print(f"save     {report['save_GBps']:.2f} GB/s   dd write+fsync {report['dd_write_GBps']:.2f} GB/s   ratio {report['save_vs_dd']:.2f} (target >= 0.8)")
        print(f"restore  {report['restore_GBps']:.2f} GB/s   dd read        {report['dd_read_GBps']:.2f} GB/s   ratio {report['restore_vs_dd']:.2f} (target >= 0.8)")
        print(f"async stall {report['async_stall_s']:.3f} s / sync save {report['sync_save_s']:.3f} s = {report['stall_vs_sync']:.3f} "
              "(target <= 0.1 on a GPU; on CPU the stall is a host memcpy of the whole state)")
    if source is not None:
        source.unlink()
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
