"""Resume read time from the node-local cache tier against the shared tier, same checkpoint, same
run; plus what writing through the cache costs a save.

    python bench/bench_local_cache.py [--state-mb 256] [--shared-dir DIR] [--local-dir DIR] [--repeats 3]

One save through the node-local dir leaves the committed checkpoint on the shared tier and its
local copy. Then resume() twice, alternating the order: without the node-local dir (every file
read from the shared tier) and with it (every shard from the local copy; `.metadata` and the
manifest always come from the shared tier). Before each resume both copies are evicted from the
page cache (posix_fadvise DONTNEED), so both read from the device.

Ratio: local resume time / shared resume time (< 1 is the cache paying off). The output says
whether the two directories are on the same device: on one machine they usually are, and then
the ratio measures only the cache's overhead (lookup, trust checks), not a faster disk; on a
cluster the shared tier is a network file system and the local tier an NVMe.
Save: a blocking save through the cache (DCP write to local + one read that hashes and copies to
shared) over a blocking save straight to the shared tier.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckptsup  # noqa: E402
from bench_save import build, evict_tree  # noqa: E402  (the same state and page-cache eviction as the save bench)

LOCAL_ENV = "CKPTSUP_NODE_LOCAL_DIR"
QUIET = {"keep_daily_days": 0, "test_load_every": 0, "keep_last": 10, "save_every_s": 1e9, "jitter_s": 0}


def save(model, opt, ck: Path, local: Path | None) -> float:
    if local is None:
        os.environ.pop(LOCAL_ENV, None)
    else:
        os.environ[LOCAL_ENV] = str(local)
    run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=str(ck), **QUIET)
    run.next_step = 1
    result = run.save(reason="bench", blocking=True)
    assert result is not None and result.ok, result
    run.close(final_save=False)
    return result.total_s


def resume(model, opt, ck: Path, local: Path | None) -> tuple[float, dict[str, int]]:
    if local is None:
        os.environ.pop(LOCAL_ENV, None)
    else:
        os.environ[LOCAL_ENV] = str(local)
    evict_tree(ck)
    evict_tree(local or ck)
    run = ckptsup.attach(model=model, optimizer=opt, checkpoint_dir=str(ck), **QUIET)
    t0 = time.perf_counter()
    assert run.resume() == 1
    elapsed = time.perf_counter() - t0
    tiers = run.load_tiers
    run.close(final_save=False)
    return elapsed, tiers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-mb", type=int, default=256)
    ap.add_argument("--shared-dir", default=None, help="shared-tier directory (default: a temp dir under /tmp)")
    ap.add_argument("--local-dir", default=None, help="node-local directory (default: a temp dir under /tmp)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for key in [k for k in os.environ if k.startswith("CKPTSUP_")]:
        del os.environ[key]
    made = []
    dirs = []
    for given, prefix in ((args.shared_dir, "ckptsup-bench-shared-"), (args.local_dir, "ckptsup-bench-local-")):
        path = Path(given or tempfile.mkdtemp(prefix=prefix))
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        dirs.append(path)
        if given is None:
            made.append(path)
    shared, local_base = dirs
    same_device = os.stat(shared).st_dev == os.stat(local_base).st_dev
    model, opt = build(args.state_mb)

    shared_s, local_s, via_cache_s, direct_s = [], [], [], []
    nbytes = 0
    for i in range(args.repeats):
        ck, local, direct = shared / f"ck{i}", local_base / f"local{i}", shared / f"direct{i}"
        for via_cache in ((True, False) if i % 2 == 0 else (False, True)):   # alternate: writeback of one hits the next
            if via_cache:
                via_cache_s.append(save(model, opt, ck, local))
            else:
                direct_s.append(save(model, opt, direct, None))
        shutil.rmtree(direct)
        nbytes = sum(f.stat().st_size for f in (ck / "step_1").iterdir())
        order = (None, local) if i % 2 == 0 else (local, None)   # alternate: neither always runs first
        for source in order:
            elapsed, tiers = resume(model, opt, ck, source)
            if source is None:
                assert tiers["read_local_files"] == 0 and tiers["read_shared_files"] > 0, tiers
                shared_s.append(elapsed)
            else:
                assert tiers["read_shared_files"] == 0 and tiers["read_local_files"] > 0, tiers
                local_s.append(elapsed)
        shutil.rmtree(ck)
        shutil.rmtree(local)

    med = statistics.median
    report = {
        "state_bytes": nbytes, "repeats": args.repeats, "shared_dir": str(shared), "local_dir": str(local_base),
        "same_device": same_device,
        "resume_shared_s": med(shared_s), "resume_local_s": med(local_s), "resume_local_vs_shared": med(local_s) / med(shared_s),
        "save_direct_s": med(direct_s), "save_via_cache_s": med(via_cache_s), "save_via_cache_vs_direct": med(via_cache_s) / med(direct_s),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"checkpoint {nbytes / 1e6:.0f} MB, median of {args.repeats}; shared {shared}, node-local {local_base}")
        print(f"resume  from shared {report['resume_shared_s']:.3f} s   from node-local {report['resume_local_s']:.3f} s   "
              f"ratio local/shared {report['resume_local_vs_shared']:.2f}")
        print(f"save    straight to shared {report['save_direct_s']:.3f} s   through the cache {report['save_via_cache_s']:.3f} s   "
              f"ratio {report['save_via_cache_vs_direct']:.2f} (the cache writes the bytes twice)")
        if same_device:
            print("NOTE: both directories are on the same device here, so the resume ratio measures the cache's overhead "
                  "only; the cache pays off where the shared tier is slower than the node's disk (a network file system).")
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
