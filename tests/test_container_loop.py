"""Containers in the supervisor's loop, in-process (the fake agents of tests/test_supervisor_loop.py):
a restart that starts agents in containers has a container phase of its own, and an agent of another
wire version ends the run in one line at its hello. The real runs are tests/test_container_slurm.py."""

from __future__ import annotations

import pytest

from ckptsup.container import ContainerPlan, Runtime
from ckptsup.env import ExitStatus
from ckptsup.errors import ConfigError
from ckptsup.events import Event
from ckptsup.wire import WIRE_VERSION

from test_supervisor_loop import Clock, Fault, World, of, site, supervisor  # noqa: F401 - site is a fixture
from test_supervisor_loop import test_dead_agents_turn_the_fast_path_into_the_node_path as dead_agents

HELLO = {"version": "0.1.0", "wire": WIRE_VERSION, "pid": 1, "container": "oci", "node_from": "container id"}


def test_a_restart_that_starts_agents_in_containers_has_a_container_phase(tmp_path, site, monkeypatch):
    import test_supervisor_loop as loop_tests

    plan = ContainerPlan(runtime=Runtime.OCI, bundle="/b")
    made = loop_tests.supervisor

    def boxed(*args, **kwargs):
        sv = made(*args, **kwargs)
        sv.placement.container = plan   # the loop reads it from the placement, as the launch gave it
        return sv

    monkeypatch.setattr(loop_tests, "supervisor", boxed)
    monkeypatch.setattr(loop_tests, "World", lambda **kw: World(agent_hello=HELLO, **kw))
    dead_agents(tmp_path, site)   # a crash whose agents die: the restart starts a new step of agents
    [done] = of(tmp_path, Event.RESTART_DONE)
    assert "container_s" in done["phases"] and list(done["phases"])[:3] == ["kill_s", "health_s", "container_s"]
    started = of(tmp_path, Event.AGENT_STARTED)
    assert len(started) == 2 and all(e["container"] == "oci" and e["pid"] == 1 for e in started)


def test_bare_metal_restarts_have_no_container_phase(tmp_path, site):
    dead_agents(tmp_path, site)
    [done] = of(tmp_path, Event.RESTART_DONE)
    assert "container_s" not in done["phases"]


def test_an_agent_of_another_wire_ends_the_run_in_one_line_at_its_hello(tmp_path, site):
    world = World(clock=Clock(), agent_hello={**HELLO, "version": "9.0.0", "wire": WIRE_VERSION + 1})
    with pytest.raises(ConfigError, match=r"runs ckptsup 9\.0\.0 \(wire \d+\).*install ckptsup=="):
        supervisor(tmp_path, world).run()
    [give_up] = of(tmp_path, Event.GIVE_UP)
    assert "cannot work together" in give_up["reason"] and not of(tmp_path, Event.LAUNCH)[1:]


def test_another_version_of_the_same_wire_is_a_warning_and_the_run_completes(tmp_path, site):
    world = World(clock=Clock(), agent_hello={**HELLO, "version": "0.0.9"})
    assert supervisor(tmp_path, world).run() is ExitStatus.DONE
    assert [e["version"] for e in of(tmp_path, Event.AGENT_STARTED)] == ["0.0.9"]
