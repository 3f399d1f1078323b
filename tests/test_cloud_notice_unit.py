"""Cloud preemption notices (docs/cloud.md): each cloud's protocol against a real HTTP server on
127.0.0.1 that speaks it (tests/cloud_metadata_helpers.py), failure answers included; the DMI
detection on a fake DMI root; the notice's config; the pure decision (plan_notice)."""

from __future__ import annotations

import datetime as dt
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ckptsup import messages
from ckptsup.config import load_config
from ckptsup.errors import ConfigError
from ckptsup.supervisor.job.preemption import NoticeWay, StopKind, plan_notice, plan_stop
from ckptsup.supervisor.node import cloud_notice as cn
from ckptsup.supervisor.node.cloud_notice import Cloud, Notice, NoticeWatch, Poller, Problem
from ckptsup.wire import MessageKind

from cloud_metadata_helpers import MetadataServer

NOW = time.time()


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc1123(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")


@pytest.fixture
def server():
    with MetadataServer() as s:
        yield s


def poller(server: MetadataServer, cloud: Cloud, node: str = "n1", timeout_s: float = 1.0) -> Poller:
    return Poller(cloud=cloud, endpoint=server.url, node=node, timeout_s=timeout_s)


# ---- AWS IMDSv2 -----------------------------------------------------------------------------------
def test_aws_404_is_no_notice_and_the_token_is_asked_for_once(server: MetadataServer) -> None:
    p = poller(server, Cloud.AWS)
    assert p.poll() is None
    assert p.poll() is None
    assert server.count("PUT /latest/api/token") == 1   # the token is kept for its TTL
    assert server.count("GET /latest/meta-data/spot/instance-action") == 2


def test_aws_instance_action_is_a_notice_for_its_time(server: MetadataServer) -> None:
    when = int(time.time()) + 120   # now, not the module's import: a suite reaches this test minutes later
    server.aws_action = {"n1": f'{{"action": "terminate", "time": "{iso(when)}"}}'}
    answer = poller(server, Cloud.AWS, node="n1").poll()
    assert isinstance(answer, Notice)
    assert (answer.cloud, answer.action, answer.deadline) == (Cloud.AWS, "terminate", when)
    assert 100 < answer.ahead_s(time.time()) <= 120
    assert answer.deadline_iso() == iso(when)
    # another node asking the same server gets its own answer (keyed by the node in the User-Agent)
    assert poller(server, Cloud.AWS, node="n2").poll() is None


@pytest.mark.parametrize("action", ["stop", "hibernate"])
def test_aws_stop_and_hibernate_are_notices_too(server: MetadataServer, action: str) -> None:
    server.aws_action = {"n1": f'{{"action": "{action}", "time": "{iso(NOW + 60)}"}}'}
    answer = poller(server, Cloud.AWS).poll()
    assert isinstance(answer, Notice) and answer.action == action


@pytest.mark.parametrize("status", [401, 403])
def test_aws_token_refused_is_a_problem_naming_the_status(server: MetadataServer, status: int) -> None:
    server.aws_token_status = status
    answer = poller(server, Cloud.AWS).poll()
    assert isinstance(answer, Problem) and answer.kind == f"aws-token-{status}"
    assert f"HTTP {status}" in answer.text and "\n" not in answer.text


def test_aws_a_token_the_service_no_longer_takes_is_replaced(server: MetadataServer) -> None:
    p = poller(server, Cloud.AWS)
    assert p.poll() is None
    server.aws_tokens.clear()   # the service forgot it (expired): 401 on the GET
    answer = p.poll()
    assert isinstance(answer, Problem) and answer.kind == "aws-http-401"
    assert p.poll() is None     # a new token, and the notice check works again
    assert server.count("PUT /latest/api/token") == 2


def test_aws_the_get_without_a_token_is_refused_as_imdsv2_does(server: MetadataServer) -> None:
    request = urllib.request.Request(f"{server.url}/latest/meta-data/spot/instance-action")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=2)
    assert err.value.code == 401


def test_aws_a_server_error_and_malformed_answers_are_problems(server: MetadataServer) -> None:
    p = poller(server, Cloud.AWS)
    server.aws_action = {"n1": (500, "Internal Server Error")}
    assert isinstance(a := p.poll(), Problem) and a.kind == "aws-http-500"
    for body in ("{not json", '{"action": "explode", "time": "2026-01-01T00:00:00Z"}',
                 '{"action": "terminate", "time": "tomorrow"}', "[1, 2]", '{"action": "terminate"}', "{" * 500):
        server.aws_action = {"n1": body}
        answer = p.poll()
        assert isinstance(answer, Problem) and answer.kind == "aws-malformed", body
        assert "\n" not in answer.text and len(answer.text) < 300


def test_a_timeout_is_a_problem_not_a_hang(server: MetadataServer) -> None:
    server.delay_s = 1.0
    p = poller(server, Cloud.AWS, timeout_s=0.2)
    t0 = time.monotonic()
    answer = p.poll()
    assert time.monotonic() - t0 < 0.9
    assert isinstance(answer, Problem) and answer.kind == "aws-timeout"


def test_nothing_listening_is_a_problem() -> None:
    p = Poller(cloud=Cloud.GCP, endpoint="http://127.0.0.1:9", node="n1", timeout_s=0.5)
    answer = p.poll()
    assert isinstance(answer, Problem) and answer.kind in ("gcp-unreachable", "gcp-timeout")


def test_the_answer_is_read_bounded(server: MetadataServer) -> None:
    server.aws_action = {"n1": '{"action": "terminate", "time": "' + "9" * (cn.MAX_BODY * 2) + '"}'}
    answer = poller(server, Cloud.AWS).poll()
    assert isinstance(answer, Problem) and answer.kind == "aws-malformed"


def test_proxies_from_the_environment_are_not_used(server: MetadataServer, monkeypatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert poller(server, Cloud.AWS).poll() is None


# ---- GCP ------------------------------------------------------------------------------------------
def test_gcp_false_true_and_the_30_seconds(server: MetadataServer) -> None:
    p = poller(server, Cloud.GCP)
    assert p.poll() is None
    server.gcp_preempted = {"n1"}
    first = p.poll()
    assert isinstance(first, Notice) and first.action == "preempted"
    assert 29 <= first.ahead_s(time.time()) <= 30
    again = p.poll()   # the same notice: its deadline runs from the poll that first saw TRUE
    assert isinstance(again, Notice) and again.key() == first.key()
    assert all(h.get("metadata-flavor") == "Google" for h in server.headers("GET /computeMetadata/v1/instance/preempted"))


def test_gcp_without_the_metadata_flavor_header_is_403_as_gcp_answers(server: MetadataServer) -> None:
    request = urllib.request.Request(f"{server.url}/computeMetadata/v1/instance/preempted")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=2)
    assert err.value.code == 403
    answer = cn.parse_gcp(403, b"", NOW)
    assert isinstance(answer, Problem) and "Metadata-Flavor" in answer.text


def test_gcp_anything_but_true_or_false_is_a_problem(server: MetadataServer) -> None:
    server.gcp_body = "MAYBE"
    answer = poller(server, Cloud.GCP).poll()
    assert isinstance(answer, Problem) and answer.kind == "gcp-malformed"


# ---- Azure Scheduled Events -----------------------------------------------------------------------
def azure_doc(*events: dict) -> str:
    import json

    return json.dumps({"DocumentIncarnation": 3, "Events": list(events)})


def azure_event(kind: str, resources: list[str], not_before: str) -> dict:
    return {"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": kind, "ResourceType": "VirtualMachine",
            "Resources": resources, "EventStatus": "Scheduled", "NotBefore": not_before,
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}


def test_azure_no_events_and_events_for_another_vm_are_no_notice(server: MetadataServer) -> None:
    server.azure_names = {"n1": "vm-n1"}
    p = poller(server, Cloud.AZURE)
    assert p.poll() is None
    server.azure_doc = azure_doc(azure_event("Preempt", ["vm-n2"], rfc1123(NOW + 30)),
                                 azure_event("Reboot", ["vm-n1"], rfc1123(NOW + 600)))
    assert p.poll() is None
    assert server.count("GET /metadata/instance/compute/name") == 1   # the VM's name is asked once


def test_azure_a_preempt_event_for_this_vm_is_a_notice_for_its_not_before(server: MetadataServer) -> None:
    server.azure_names = {"n1": "vm-n1"}
    when = int(NOW) + 30
    server.azure_doc = azure_doc(azure_event("Preempt", ["vm-n2", "vm-n1"], rfc1123(when)))
    answer = poller(server, Cloud.AZURE).poll()
    assert isinstance(answer, Notice)
    assert (answer.cloud, answer.action, answer.deadline) == (Cloud.AZURE, "preempt", when)
    assert all(h.get("metadata") == "true" for h in server.headers("GET /metadata/scheduledevents"))


def test_azure_a_started_event_has_no_time_left() -> None:
    doc = azure_doc(azure_event("Preempt", ["vm-n1"], "")).encode()
    answer = cn.parse_azure(200, doc, frozenset({"vm-n1"}), NOW)
    assert isinstance(answer, Notice) and answer.deadline == NOW


def test_azure_without_the_metadata_header_is_400_and_malformed_documents_are_problems(server: MetadataServer) -> None:
    request = urllib.request.Request(f"{server.url}/metadata/scheduledevents?api-version=2020-07-01")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=2)
    assert err.value.code == 400
    names = frozenset({"vm-n1"})
    for body in (b"{}", b'{"Events": [1]}', b'{"Events": [{"EventType": "Preempt"}]}',
                 azure_doc(azure_event("Preempt", ["vm-n1"], "soon")).encode()):
        answer = cn.parse_azure(200, body, names, NOW)
        assert isinstance(answer, Problem) and answer.kind == "azure-malformed", body


# ---- the watch: each notice once, each kind of problem warned once ------------------------------------
def test_the_watch_reports_a_notice_once_and_a_problem_kind_once(server: MetadataServer) -> None:
    warned: list[str] = []
    watch = NoticeWatch(poller(server, Cloud.AWS), warn=warned.append)
    server.aws_action = {"n1": (500, "oops")}
    watch.once()
    watch.once()
    assert len(warned) == 1 and "HTTP 500" in warned[0]
    server.aws_action = {"n1": f'{{"action": "terminate", "time": "{iso(NOW + 120)}"}}'}
    watch.once()
    watch.once()
    found = watch.take()
    assert len(found) == 1 and found[0].action == "terminate"
    assert watch.take() == []


def test_the_watch_thread_polls_and_stops(server: MetadataServer) -> None:
    server.gcp_preempted = {"n1"}
    watch = NoticeWatch(poller(server, Cloud.GCP), every_s=0.05).start()
    try:
        deadline = time.monotonic() + 5
        found: list[Notice] = []
        while not found and time.monotonic() < deadline:
            found = watch.take()
            time.sleep(0.02)
        assert found and found[0].cloud is Cloud.GCP
    finally:
        watch.close()
    assert not watch.thread.is_alive()


# ---- which cloud: DMI ---------------------------------------------------------------------------------
def dmi(tmp_path: Path, **fields: str) -> Path:
    root = tmp_path / "dmi"
    root.mkdir()
    for name, value in fields.items():
        (root / name).write_text(value + "\n")
    return root


@pytest.mark.parametrize(("fields", "cloud"), [
    ({"sys_vendor": "Amazon EC2", "bios_vendor": "Amazon EC2", "product_name": "p4d.24xlarge"}, Cloud.AWS),
    ({"sys_vendor": "Xen", "bios_vendor": "Xen", "bios_version": "4.11.amazon"}, Cloud.AWS),
    ({"sys_vendor": "Google", "bios_vendor": "Google", "product_name": "Google Compute Engine"}, Cloud.GCP),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
      "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"}, Cloud.AZURE),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
      "chassis_asset_tag": "None"}, None),   # Hyper-V on premises
    ({"sys_vendor": "Dell Inc.", "product_name": "PowerEdge XE9680"}, None),
    ({}, None),
])
def test_the_cloud_is_read_from_the_dmi_strings(tmp_path: Path, fields: dict, cloud: Cloud | None) -> None:
    root = dmi(tmp_path, **fields)
    assert cn.resolve("auto", root) is cloud
    assert cn.resolve("off", root) is None
    assert cn.resolve("gcp", root) is Cloud.GCP   # forced, whatever the node says


def test_no_dmi_directory_is_no_cloud(tmp_path: Path) -> None:
    assert cn.resolve("auto", tmp_path / "absent") is None
    assert cn.watch("auto", {}, "n1", dmi_root=tmp_path / "absent") is None


# ---- the wire message ----------------------------------------------------------------------------------
def test_the_cloud_notice_message_round_trips_and_refuses_junk() -> None:
    msg = messages.CloudNotice(cloud="aws", action="terminate", deadline="2026-05-01T10:02:00Z", ahead_s=118.5,
                               detail="spot instance-action terminate")
    assert messages.parse(MessageKind.CLOUD_NOTICE, msg.to_body()) == msg
    from ckptsup.wire import FrameError

    for bad in ({**msg.to_body(), "cloud": "oracle"}, {**msg.to_body(), "ahead_s": -1},
                {k: v for k, v in msg.to_body().items() if k != "deadline"}):
        with pytest.raises(FrameError):
            messages.parse(MessageKind.CLOUD_NOTICE, bad)


# ---- config -------------------------------------------------------------------------------------------
def test_the_config_defaults_and_an_endpoint_of_a_site(tmp_path: Path) -> None:
    resolved = load_config(env={})
    pre = resolved.config.preemption
    assert (pre.cloud_notice, pre.aws_endpoint, pre.gcp_endpoint, pre.azure_endpoint) == (
        "auto", "http://169.254.169.254", "http://metadata.google.internal", "http://169.254.169.254")
    job = tmp_path / "job.toml"
    job.write_text('[preemption]\ncloud_notice = "aws"\naws_endpoint = "http://imds-proxy.site:8080/aws"\n')
    pre = load_config(job_config=job, env={}).config.preemption
    assert (pre.cloud_notice, pre.aws_endpoint) == ("aws", "http://imds-proxy.site:8080/aws")


@pytest.mark.parametrize(("line", "needle"), [
    ('cloud_notice = "oracle"', "auto, aws, gcp, azure, off"),
    ('aws_endpoint = "https://169.254.169.254"', "http:// URL"),
    ('gcp_endpoint = "169.254.169.254"', "http:// URL"),
    ('azure_endpoint = "http://169.254.169.254/?x=1"', "http:// URL"),
    ('aws_endpoint = "http://user:pw@169.254.169.254"', "http:// URL"),
    ('aws_endpoint = "http://169.254.169.254:99999"', "http:// URL"),
    ('aws_endpoint = "http://a b"', "http:// URL"),
])
def test_a_bad_preemption_knob_is_one_line_naming_the_key(tmp_path: Path, line: str, needle: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(f"[preemption]\n{line}\n")
    with pytest.raises(ConfigError) as err:
        load_config(job_config=job, env={})
    text = str(err.value)
    assert needle in text and "preemption." in text and "\n" not in text


# ---- the decision (pure) ------------------------------------------------------------------------------
def plan(**kw):
    config = load_config(env={}).config
    base = dict(node="n2", ahead_s=120.0, config=config, active=("n1", "n2"), spares=("n3",), excluded=frozenset(),
                can_requeue=True, checkpoints=True, save_s=2.0, write_s=4.0, elapsed_s=0.5, step_p99_s=0.2)
    return plan_notice(**{**base, **kw})


def test_a_save_that_fits_before_the_deadline_is_taken_then_the_node_moves() -> None:
    p = plan()
    assert p.way is NoticeWay.SAVE_AND_MOVE and p.emergency_save
    assert p.save_needed_s == pytest.approx((2.0 + 4.0) * 1.5)
    assert p.budget_s == pytest.approx(120.0 - 0.5 - 0.2 - 5.0)
    assert p.move_by_s == pytest.approx(120.0 - 0.5 - 5.0)
    assert "n3" in p.reason and "fits" in p.reason


def test_a_save_that_does_not_fit_moves_the_node_now_from_the_newest_checkpoint() -> None:
    p = plan(ahead_s=30.0, save_s=10.0, write_s=20.0)   # GCP's 30 s against a 45 s save
    assert p.way is NoticeWay.MOVE and not p.emergency_save
    assert "does not fit" in p.reason


def test_an_unmeasured_save_or_ranks_without_checkpoints_move_at_once() -> None:
    assert plan(save_s=None, write_s=None).way is NoticeWay.MOVE
    assert plan(checkpoints=False).way is NoticeWay.MOVE


def test_no_spare_requeues_without_the_node_and_nowhere_to_go_stops() -> None:
    p = plan(spares=())
    assert p.way is NoticeWay.SAVE_AND_MOVE and "requeued without n2" in p.reason
    assert plan(spares=(), can_requeue=False).way is NoticeWay.STOP


def test_a_spare_is_excluded_and_an_excluded_node_ignored() -> None:
    assert plan(node="n3").way is NoticeWay.EXCLUDE
    assert plan(node="n2", excluded=frozenset({"n2"})).way is NoticeWay.IGNORE
    assert plan(node="n9").way is NoticeWay.IGNORE


def test_the_stop_plan_of_a_notice_uses_its_window() -> None:
    config = load_config(env={}).config
    stop = plan_stop(kind=StopKind.CLOUD_NOTICE, config=config, save_s=2.0, notice_s=60.0, elapsed_s=1.0,
                     step_p99_s=0.5)
    assert stop.window_s == 60.0 and stop.budget_s == pytest.approx(60.0 - 1.0 - 0.5 - 5.0)
    assert stop.emergency_save and stop.as_event()["signal"] == "cloud_notice"


# ---- the supervisor's loop, in-process (tests/test_supervisor_loop.py's scripted agent step) ----------
from test_supervisor_loop import Clock, FakeSlurm, FakeStep, Fault, World, of, supervisor  # noqa: E402
from ckptsup.env import ExitStatus  # noqa: E402
from ckptsup.events import Event  # noqa: E402
from ckptsup.rundir import RunDir  # noqa: E402
from ckptsup.supervisor.job import loop as loop_mod  # noqa: E402

MEASURED = {"event": "checkpoint_committed", "step": 0, "stall_s": 0.1, "write_s": 0.2}


class CloudStep(FakeStep):
    """A scripted agent step whose Fault("cloud", step, node) is a spot notice from `node` at
    that step; the ranks answer save_now with a commit at the next step."""

    def strike(self, fault: Fault, ranks: list[tuple[str, int]]) -> None:
        if fault.kind != "cloud":
            return super().strike(fault, ranks)
        self.at = fault.step
        self.put(MessageKind.CLOUD_NOTICE, fault.node, cloud="aws", action="terminate",
                 deadline="2026-05-01T10:02:00Z", ahead_s=120.0, detail="spot instance-action terminate")

    def send(self, msg: messages.Body, *, nodes=None) -> bool:
        sent = super().send(msg, nodes=nodes)
        if isinstance(msg, messages.SaveNow):
            self.put(MessageKind.EVENT, self.active[0], record={"event": "checkpoint_committed", "step": self.at + 1,
                                                                 "stall_s": 0.1, "write_s": 0.2})
        return sent


class CloudWorld(World):
    def factory(self, *, nodes, inbox, argv, **_):
        from ckptsup.supervisor.spec import LaunchSpec

        self.steps_made.append(len(self.steps_made))
        step = CloudStep(world=self, nodes=tuple(nodes), inbox=inbox, step_id=100 + len(self.steps_made))
        step.play(tuple(LaunchSpec.read(argv[argv.index("--spec") + 1]).node_addrs))
        return step


@pytest.fixture
def loop_site(tmp_path, monkeypatch):
    monkeypatch.setattr(loop_mod, "TICK_S", 0.001)
    path = tmp_path / "site.toml"
    path.write_text("[supervisor]\nhang_min_s = 3.0\nheartbeat_interval_s = 0.5\nnode_silence_s = 4.0\n"
                    "[checkpoint]\nadaptive_interval = false\n[health]\nenabled = true\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(path))


def test_the_loop_saves_then_moves_the_noticed_node_to_the_spare_without_draining_it(tmp_path, loop_site):
    slurm = FakeSlurm()
    world = CloudWorld(clock=Clock(), faults={0: Fault("cloud", 3, node="n2")}, events=[MEASURED])
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=slurm,
                    flags={"preemption.cloud_notice": "aws"})
    assert sv.run() is ExitStatus.DONE
    [notice] = of(tmp_path, Event.CLOUD_NOTICE)
    assert (notice["node"], notice["way"], notice["emergency_save"]) == ("n2", "save_and_move", True)
    kinds = [m for _, m, _, _ in world.sent]
    assert kinds.index(MessageKind.SAVE_NOW) < kinds.index(MessageKind.KILL)   # the checkpoint first
    [moved] = of(tmp_path, Event.FAILURE_DETECTED)
    assert moved["kind"] == "replaced" and moved["node"] == "n2" and moved["step"] is not None
    assert [e["nodes"] for e in of(tmp_path, Event.LAUNCH)] == [["n1", "n2"], ["n1", "n3"]]
    [excluded] = of(tmp_path, Event.NODE_EXCLUDED)
    assert excluded["node"] == "n2" and excluded["drained"] is False and slurm.drained == []
    state = RunDir(path=tmp_path / "run").load_state()
    assert "n2" in state.excluded_nodes and state.restarts == 0   # no restart budget spent
    # the launch spec carried the knobs to the agents
    from ckptsup.supervisor.spec import LaunchSpec

    spec = LaunchSpec.read(tmp_path / "run" / "attempt-0" / "launch.json")
    assert spec.cloud_notice == "aws" and spec.cloud_endpoints["aws"] == "http://169.254.169.254"


def test_the_loop_moves_at_once_when_no_save_was_measured(tmp_path, loop_site):
    world = CloudWorld(clock=Clock(), faults={0: Fault("cloud", 3, node="n2")})
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=FakeSlurm())
    assert sv.run() is ExitStatus.DONE
    [notice] = of(tmp_path, Event.CLOUD_NOTICE)
    assert notice["way"] == "move" and not notice["emergency_save"]
    assert MessageKind.SAVE_NOW not in [m for _, m, _, _ in world.sent]
    assert of(tmp_path, Event.LAUNCH)[-1]["nodes"] == ["n1", "n3"]


def test_the_loop_stops_a_local_run_as_a_preemption_when_nothing_can_take_the_node(tmp_path, loop_site):
    world = CloudWorld(clock=Clock(), faults={0: Fault("cloud", 3, node="n1")}, events=[MEASURED])
    sv = supervisor(tmp_path, world, nodes=("n1",), needed=1)
    assert sv.run() is ExitStatus.PREEMPTED
    [notice] = of(tmp_path, Event.CLOUD_NOTICE)
    assert notice["way"] == "stop"
    [stop] = of(tmp_path, Event.PREEMPTION)
    assert stop["signal"] == "cloud_notice" and stop["emergency_save"] is True and 100 < stop["window_s"] <= 120
    assert MessageKind.STOP_AT in [m for _, m, _, _ in world.sent]


def test_a_notice_for_a_spare_excludes_it_and_the_run_goes_on(tmp_path, loop_site):
    class SpareNotice(CloudStep):
        def play(self, launch):
            if self.world.launches == 0:
                self.put(MessageKind.CLOUD_NOTICE, "n3", cloud="gcp", action="preempted",
                         deadline="2026-05-01T10:02:00Z", ahead_s=30.0)
            super().play(launch)

    class SpareWorld(CloudWorld):
        def factory(self, *, nodes, inbox, argv, **_):
            from ckptsup.supervisor.spec import LaunchSpec

            step = SpareNotice(world=self, nodes=tuple(nodes), inbox=inbox, step_id=101)
            step.play(tuple(LaunchSpec.read(argv[argv.index("--spec") + 1]).node_addrs))
            return step

    world = SpareWorld(clock=Clock())
    sv = supervisor(tmp_path, world, nodes=("n1", "n2", "n3"), needed=2, in_slurm=True, slurm=FakeSlurm())
    assert sv.run() is ExitStatus.DONE
    [notice] = of(tmp_path, Event.CLOUD_NOTICE)
    assert (notice["node"], notice["way"]) == ("n3", "exclude")
    assert [e["node"] for e in of(tmp_path, Event.NODE_EXCLUDED)] == ["n3"]
    assert not of(tmp_path, Event.FAILURE_DETECTED)


def test_a_notice_far_ahead_or_at_an_odd_time_still_makes_a_valid_frame() -> None:
    for deadline in (NOW + 365 * 86400, 1e18, -1e18, NOW - 60):
        notice = Notice(cloud=Cloud.AZURE, action="terminate", deadline=deadline)
        msg = messages.CloudNotice(cloud="azure", action=notice.action, deadline=notice.deadline_iso(),
                                   ahead_s=notice.ahead_s(NOW))
        assert messages.parse(MessageKind.CLOUD_NOTICE, msg.to_body()) == msg
