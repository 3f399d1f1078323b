"""Issue 39 parts 1-2 on the real dev cluster: the heartbeat tree with `relay_above_nodes` forced low
(1: every job of 2 nodes or more relays), so that the first node of each attempt takes its
neighbour's heartbeats over TCP and summarises them. One run, two faults chained: a CHILD node dies
(found by its silence and its slurmd, blamed on it alone, its relay unharmed), then, on the new node
set, the RELAY node dies (blamed on it alone; its child goes back to stdout and is neither declared
dead nor excluded). The run ends with the uninterrupted reference's parameters. The pure parts and
the transport: tests/test_relays.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ckptsup.events import read_events
from ckptsup.supervisor.job.relays import plan

from run_helpers import named, node_deaths
from supervisor_slurm_helpers import committed, reference, submit  # noqa: F401 - reference is a fixture

pytestmark = [pytest.mark.slurm, pytest.mark.torch]


def agents_said(run: Path, text: str) -> bool:
    """A line of the agents' logs (each attempt's agents.log) holds `text`."""
    return any(text in log.read_text(errors="replace") for log in run.rglob("agents.log"))


def tree(run: Path, attempt: int) -> tuple[str, str]:
    """(relay, child) of that attempt's launch: 2 nodes, one block, its first node relays."""
    launch = named(read_events(run), "launch")[attempt]
    [(relay, (child,))] = plan(launch["nodes"], 1).items()
    return relay, child


def holding(run: Path, after: str = "") -> bool:
    """The ranks hold before step 40 (an eval phase, outside any collective) since `after` (a ts)."""
    return any(e.get("phase") == "eval" and e["ts"] > after for e in named(read_events(run), "phase"))


def test_a_childs_death_is_the_childs_and_a_relays_death_is_the_relays_alone(dev_cluster, tmp_path, reference):
    release = tmp_path / "release"   # the ranks hold before step 40 (signs of life, no step) until both faults are in
    # the batch host (the supervisor's node) is the last spare: the relays killed here are never it
    job, run, out = submit(tmp_path, nodes=2, spares=2, supervisor_toml="relay_above_nodes = 1\nbatch_host_spare = true\n",
                           extra=("--hold-at-step", "40", "--hold-file", str(release)))
    dev_cluster.wait_for(lambda: committed(run, 10) and holding(run), 180, what="the ranks holding before step 40")
    relay, child = tree(run, 0)
    # the child's agent sends its heartbeats to its relay's listener, not to stdout
    dev_cluster.wait_for(lambda: agents_said(run, f"{relay} takes the heartbeats of 1 nodes")
                         and agents_said(run, f"{child} sends its heartbeats to its relay"), 60, what="the tree")
    with dev_cluster.revived(child):
        dev_cluster.kill_node(child)
        dev_cluster.wait_for(lambda: node_deaths(read_events(run)), 60, what="the child's death")
        # the relaunch (its restart_done comes with its first step, after the hold)
        dev_cluster.wait_for(lambda: len(named(read_events(run), "launch")) >= 2, 120, what="the relaunch")
        restarted = named(read_events(run), "launch")[1]["ts"]
        relay2, child2 = tree(run, -1)
        dev_cluster.wait_for(lambda: holding(run, restarted) and agents_said(run, f"{child2} sends its heartbeats to its relay"),
                             180, what="the new node set's tree, its ranks holding")
        time.sleep(2.0)   # a few of the child's beats through its relay
        with dev_cluster.revived(relay2):
            dev_cluster.kill_node(relay2)
            dev_cluster.wait_for(lambda: len(node_deaths(read_events(run))) >= 2, 60, what="the relay's death")
            dev_cluster.wait_for(lambda: len(named(read_events(run), "launch")) >= 3, 120, what="the second relaunch")
            release.touch()
            dev_cluster.wait_for(lambda: named(read_events(run), "run_complete"), 300, what="the run to complete")
    events = read_events(run)
    deaths = node_deaths(events)
    assert [d["node"] for d in deaths] == [child, relay2], deaths   # each blamed on its own node
    assert all("slurmd does not answer" in d["detail"] for d in deaths), deaths   # found by their silence
    assert [e["node"] for e in named(events, "node_excluded")] == [child, relay2]
    # the dead relay's child went back to stdout, was never taken for dead, and trained to the end
    said = "".join(log.read_text(errors="replace") for log in run.glob("slurm-*.out"))   # the supervisor's console
    assert f"heartbeat relay {relay2} is silent: its 1 children report straight to the supervisor" in said
    assert agents_said(run, f"{child2} lost its relay")   # and its link closed: stdout at once, by itself
    assert child2 in named(events, "launch")[-1]["nodes"]
    assert child2 not in json.loads((run / "state.json").read_text())["excluded_nodes"]
    assert json.loads((out / "final.json").read_text())["params_sha256"] == reference
