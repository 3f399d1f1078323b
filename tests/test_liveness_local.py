"""Busy is not hung, at the defaults (no hang knob set), with an unmodified 2-rank DDP script
(tests/helpers/plain_ddp.py: only rank 0 prints) under `ckptsup launch` (docs/timeouts.md
§Evidence): a rank sleeping forever is a hang within 15 s of its last step, named with where it
sleeps or in which collective (in warm interpreters, and in cold ranks with warm ranks off), and no node is suspected; ranks computing or reading without printing are busy, never killed."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptsup.events import read_events

from drop_in_helpers import SCRIPT, reference, same_model
from run_helpers import config_args, named

pytestmark = pytest.mark.integration

CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]
STEPS = 60


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    return reference(tmp_path_factory.mktemp("liveness-reference"), STEPS)


def launch(tmp: Path, *faults: str, script: Path = SCRIPT, config: str | None = None
           ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    run = tmp / "run"
    argv = [*CKPTSUP, "launch", *config_args(tmp, config), "--nproc-per-node", "2", "--run-dir", str(run), str(script), "--steps", str(STEPS),
            "--ckpt-dir", str(tmp / "ckpt"), "--out", str(tmp / "final.pt"), *faults]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=tmp)
    return proc, read_events(run)


def test_a_stuck_rank_is_a_hang_named_where_it_is_and_no_node_is_suspected(tmp_path, uninterrupted):
    """Rank 1 blocks before step 24 in an all-reduce of a second group that rank 0 never enters
    (attempt 0): a hang, both ranks seen waiting in a collective, rank 1 named by the script line it
    entered from (rank 0's differs); then sleeps forever before step 45 (attempt 1): named with its
    Python frame. Both attempts' ranks run in warm interpreters forked from the node's zygote.
    No node health-checked or excluded; resumed both times; the final model is torchrun's. The
    script's user left a comment naming the supervisor at its end: a mention is no use of the
    hooks, so no hello is awaited (a wait that hid both hangs for init_timeout_s, 300 s)."""
    script = tmp_path / "job" / SCRIPT.name
    script.parent.mkdir()
    script.write_text(SCRIPT.read_text() + "\n# this job runs under `ckptsup launch` (docs/drop-in.md)\n")
    proc, events = launch(tmp_path, "--collective-at", "24", "--sleep-at", "45", script=script)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hangs = named(events, "failure_detected")
    assert [h["kind"] for h in hangs] == ["hang"] * 2 and [h["rank"] for h in hangs] == [1, 1], hangs
    assert all(10.0 <= h["detect_s"] <= 15.0 for h in hangs), [h["detect_s"] for h in hangs]   # hang_min_s = 10
    # the culprit in a collective of its own, in a cold rank: both ranks wait in c10d, rank 1 in the
    # all-reduce the script called, rank 0 in DDP's (backward): told apart by the script line each entered from
    desync, sleep = hangs
    in_collective = {r["rank"]: r for r in desync["ranks_seen"]}
    assert in_collective[1]["where"] == "waiting" and "all_reduce" in in_collective[1]["top"], in_collective
    assert in_collective[0]["where"] == "waiting", in_collective
    side = next(i for i, text in enumerate(SCRIPT.read_text().splitlines(), 1) if "group=side" in text)
    assert "rank 1 in a collective its peers never enter" in desync["detail"], desync
    assert f"from plain_ddp.py:{side}" in desync["detail"], desync["detail"]
    assert desync["stacks"] == "attempt-0/stacks" and list((tmp_path / "run" / "attempt-0" / "stacks").glob("rank*.txt"))
    line = next(i for i, text in enumerate(SCRIPT.read_text().splitlines(), 1) if "time.sleep(3600)" in text)
    assert f"rank 1 on {sleep['node']}: at plain_ddp.py:{line} in main" in sleep["detail"], sleep["detail"]
    assert "rank 0 waiting in" in sleep["detail"], sleep["detail"]
    assert len(named(events, "health_check")) == 1   # the start's: a rank stuck in its own code suspects no node
    assert not named(events, "node_excluded")
    assert [e["warm"] for e in named(events, "restart_done")] == [True, True], named(events, "restart_done")
    assert list((tmp_path / "run" / "attempt-1" / "stacks").glob("rank*.txt"))   # the stacks stay in the run dir
    # the whole evidence rides the event (ckptsup log --json), the named line the log's table
    seen = {r["rank"]: r for r in sleep["ranks_seen"]}
    assert sleep["stacks"] == "attempt-1/stacks" and set(seen) == {0, 1}, sleep
    assert seen[1]["where"] == "elsewhere" and seen[1]["top"] == f"at plain_ddp.py:{line} in main"
    assert seen[0]["where"] == "waiting" and seen[1]["cores"] < 0.05 and seen[1]["state"] == "S", seen
    shown = subprocess.run([*CKPTSUP, "log", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert f"plain_ddp.py:{line} in main" in " ".join(shown.stdout.split()) and "ranks_seen" not in shown.stdout, shown.stdout
    as_json = subprocess.run([*CKPTSUP, "log", "--json", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert '"ranks_seen"' in as_json.stdout and '"elsewhere"' in as_json.stdout, as_json.stdout[-2000:]
    assert same_model(torch.load(tmp_path / "final.pt"), uninterrupted)


def test_ranks_computing_or_reading_without_printing_are_busy_and_never_killed(tmp_path, uninterrupted):
    """20 s of silent computation on every rank at step 10, 20 s on rank 0 alone while rank 1 waits
    in dist.barrier() at step 25, then 20 s of rank 0 reading a file slowly (I/O, next to no CPU)
    at step 40: each past the 10 s hang timeout and its 5 s evidence window, none a failure."""
    proc, events = launch(tmp_path, "--busy-at", "10,25:0", "--read-at", "40:0", "--busy-s", "20")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not named(events, "failure_detected"), [(f["kind"], f["detail"]) for f in named(events, "failure_detected")]
    busy = named(events, "busy")
    assert [b["ranks"] for b in busy] == [[0, 1], [0], [0]], busy
    assert "KiB/s I/O" in busy[2]["detail"] and "(0.0" in busy[2]["detail"], busy[2]   # I/O, not CPU
    assert "busy, not hung" in proc.stdout
    # each spell ends when progress comes back, timed from its last progress (>= the 10 s timeout)
    over = named(events, "busy_over")
    assert [o["ranks"] for o in over] == [[0, 1], [0], [0]] and all(12.0 <= o["busy_s"] <= 40.0 for o in over), over
    report = subprocess.run([*CKPTSUP, "report", "--json", str(tmp_path / "run")], capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr
    busy_report = json.loads(report.stdout)["busy"]
    assert busy_report["spells"] == 3 and busy_report["busy_s"] == pytest.approx(sum(o["busy_s"] for o in over), abs=0.01)
    assert [e["attempt"] for e in named(events, "launch")] == [0] and named(events, "run_complete")
    assert same_model(torch.load(tmp_path / "final.pt"), uninterrupted)


def test_a_rank_stuck_in_a_collective_is_named_in_a_cold_rank_too(tmp_path):
    """With warm ranks off (supervisor.warm_ranks = false; a torchrun option such as --numa-binding
    does the same) every rank starts cold, through rankside/cold_rank.py, which installs the stack
    dump: rank 1 blocked before step 24 in an all-reduce that rank 0 never enters is a hang named
    from its cold process's stack like a warm one's, and the run resumes and completes."""
    proc, events = launch(tmp_path, "--collective-at", "24", config="[supervisor]\nwarm_ranks = false\n")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [hang] = named(events, "failure_detected")
    assert hang["kind"] == "hang" and hang["rank"] == 1, hang
    side = next(i for i, text in enumerate(SCRIPT.read_text().splitlines(), 1) if "group=side" in text)
    assert "rank 1 in a collective its peers never enter" in hang["detail"], hang
    assert f"from plain_ddp.py:{side}" in hang["detail"], hang["detail"]
    assert [e["warm"] for e in named(events, "restart_done")] == [False] and named(events, "run_complete")
