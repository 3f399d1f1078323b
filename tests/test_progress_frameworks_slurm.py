"""Scripts people run, unchanged, on the real dev cluster (docs/drop-in.md §Progress lines): an HF
Trainer script and a Lightning script (its default bar), without ckptsup's callbacks or import,
through the sbatch template on 2 nodes each at the defaults (an empty job config), both jobs at
once. Each is watched at the progress level from its own bar, and a rank asleep mid-step is a hang
found from the bar's silence; each run then completes."""
from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.events import read_events

from run_helpers import ended, named, run_named, sbatch_submit

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

HELPERS = Path(__file__).resolve().parent / "helpers"
FROM_LINES = "(no progress line; supervisor.progress_pattern)"   # the detail of a hang found at the progress level


def stepping(run: Path) -> bool:
    levels = run_named(run, "supervision_level")
    return bool(levels) and levels[-1]["level"] == "progress" and bool(run_named(run, "first_step"))


def test_hf_and_lightning_scripts_on_two_nodes_each_are_watched_from_their_bars(dev_cluster, tmp_path):
    jobs = {}
    for name, script in (("hf", "progress_hf.py"), ("lightning", "progress_lightning.py")):
        tmp = tmp_path / name
        tmp.mkdir()
        config = tmp / "job.toml"
        config.write_text("[supervisor]\n")   # the defaults
        extra = ("--bar", "default") if name == "lightning" else ()
        job, run = sbatch_submit(tmp, config, HELPERS / script, "--out", str(tmp / "out"), "--hang-file",
                                 str(tmp / "hang"), "--epochs", "3", "--samples", "64", "--step-s", "0.25", *extra,
                                 nodes=2, spares=0)
        jobs[name] = (job, run, tmp)
    for name, (job, run, tmp) in jobs.items():
        dev_cluster.wait_for(lambda: stepping(run), 240, what=f"{name}'s progress lines")
        (tmp / "hang").touch()
    for name, (job, run, tmp) in jobs.items():
        dev_cluster.wait_for(lambda: ended(run), 300, what=f"{name}'s job {job} to end")
        events = read_events(run)
        [hang] = named(events, "failure_detected")
        assert hang["kind"] == "hang" and hang["rank"] == 1 and FROM_LINES in hang["detail"], (name, hang)
        assert hang["detect_s"] <= 20.0, (name, hang["detect_s"])
        assert (tmp / "out" / "hung").exists()
        assert {e["level"] for e in named(events, "supervision_level")} == {"progress"}, name
        assert named(events, "run_complete"), (name, [e["event"] for e in events][-8:])
