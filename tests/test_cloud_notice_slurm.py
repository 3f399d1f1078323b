"""A cloud's spot notice for one node of a job on the real dev cluster (docs/cloud.md): the job runs
with `[preemption] cloud_notice = "aws"` and its endpoint pointed at a metadata server on 127.0.0.1
(tests/cloud_metadata_helpers.py; the cluster's nodes share the host's network) that answers
IMDSv2 for every node and posts a spot instance-action for one training node only, keyed by the
node the agent names in its User-Agent. The supervisor asks for an emergency checkpoint, the
node's ranks move to the spare once it is committed, and the run completes from that checkpoint."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from ckptsup.events import read_events

from cloud_metadata_helpers import MetadataServer
from run_helpers import named, run_named, wait_for
from supervisor_slurm_helpers import finished, submit

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

STEPS = 260
SAVE_EVERY = 100   # a save measured (stall, write) before the notice; the emergency one is not on this grid


def test_a_spot_notice_moves_the_node_to_the_spare_from_an_emergency_checkpoint(idle_cluster, tmp_path: Path) -> None:
    with MetadataServer() as server:
        # the memory tier off: the spare resumes from the emergency checkpoint on disk, nothing newer
        toml = f'[memory]\nenabled = false\n[preemption]\ncloud_notice = "aws"\naws_endpoint = "{server.url}"\n'
        job, run, out = submit(tmp_path, nodes=2, spares=1, extra_toml=toml,
                               extra=("--steps", str(STEPS), "--save-every-steps", str(SAVE_EVERY)))
        first = wait_for(lambda: named(run_named(run, "launch"), "launch"), 120, what="the first launch")[0]
        victim = first["nodes"][-1]
        wait_for(lambda: run_named(run, "checkpoint_committed"), 120, what="a measured save")
        # every agent polls (the spare's too), and nobody has had a notice yet
        assert server.count("GET /latest/meta-data/spot/instance-action") >= 3
        assert not run_named(run, "cloud_notice")
        when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=120)
        server.aws_action = {victim: f'{{"action": "terminate", "time": "{when:%Y-%m-%dT%H:%M:%SZ}"}}'}
        [notice] = wait_for(lambda: run_named(run, "cloud_notice"), 30, what="the cloud notice")
        wait_for(lambda: finished(idle_cluster, job) and named(read_events(run), "run_complete"), 120,
                 what="the run to complete")
    events = read_events(run)

    assert (notice["node"], notice["cloud"], notice["action"]) == (victim, "aws", "terminate")
    assert notice["way"] == "save_and_move" and notice["emergency_save"] is True
    assert 90 < notice["ahead_s"] <= 120 and notice["deadline"] == f"{when:%Y-%m-%dT%H:%M:%SZ}"
    at = notice["step"]
    assert at is not None and SAVE_EVERY <= at < STEPS - 20

    # the emergency checkpoint: the first commit after the notice, at the step boundary the ranks agreed on
    after = events[events.index(notice):]
    emergency = named(after, "checkpoint_committed")[0]
    assert at <= emergency["step"] <= at + 20 and emergency["step"] % SAVE_EVERY != 0

    [moved] = [e for e in named(after, "failure_detected") if e["kind"] == "replaced"]
    assert moved["node"] == victim and "cloud notice" in moved["detail"]
    [excluded] = named(after, "node_excluded")
    assert excluded["node"] == victim and excluded["drained"] is False and "cloud notice" in excluded["reason"]

    # the spare took over from the emergency checkpoint, and the run completed
    relaunch = named(after, "launch")[-1]
    assert victim not in relaunch["nodes"] and set(first["spares"]) <= set(relaunch["nodes"])
    assert relaunch["resume_from"].endswith(f"step_{emergency['step']}")
    [done] = named(after, "restart_done")
    assert done["resume_step"] == emergency["step"]
    [complete] = named(events, "run_complete")
    assert complete["step"] == STEPS - 1
    assert not named(events, "give_up") and not named(events, "requeue")
    # one console line
    log = (run / f"slurm-{job}.out").read_text(errors="replace")
    assert log.count(f"cloud notice: aws will terminate {victim}") == 1
    assert (out / "final.json").exists()
