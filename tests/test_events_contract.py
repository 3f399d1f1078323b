"""Event names are one contract: `ckptsup.events.Event`. Writers pass members (an unknown name is
refused), readers compare members (no string literal naming an event or a failure kind in a
comparison), and docs/contracts.md lists exactly the members."""

from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from ckptsup.events import Event, EventWriter, FailureKind, make_event, read_events

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ckptsup"
EVENT_VALUES = {e.value: f"Event.{e.name}" for e in Event}
KIND_VALUES = {k.value: f"FailureKind.{k.name}" for k in FailureKind}
NAMED = {**KIND_VALUES, **EVENT_VALUES}

# Comparisons whose string only happens to equal an event or failure-kind name:
# (file, the other operand as ast.unparse writes it, the string) → why it is not one.
NOT_EVENT_NAMES: dict[tuple[str, str, str], str] = {}


def _package_files() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "ckptsup/events.py":
            continue
        out.append((rel, ast.parse(path.read_text(encoding="utf-8"), filename=rel)))
    return out


def _compared_literals(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, string, the other operand) for every string constant that is an operand of a
    comparison (an element of a tuple/list/set operand included) or a `case` value."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                other = operands[i - 1] if i else operands[1]
                for item in items:
                    if isinstance(item, ast.Constant) and isinstance(item.value, str):
                        found.append((item.lineno, item.value, ast.unparse(other)))
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            found.append((node.value.lineno, node.value.value, "match"))
    return found


def _violations(rel: str, tree: ast.Module, used: set[tuple[str, str, str]]) -> list[str]:
    out = []
    for line, value, other in _compared_literals(tree):
        if value not in NAMED:
            continue
        if (rel, other, value) in NOT_EVENT_NAMES:
            used.add((rel, other, value))
            continue
        out.append(f"{rel}:{line}: {value!r} compared with {other} (use {NAMED[value]})")
    return out


def test_no_reader_compares_an_event_or_failure_kind_as_a_string_literal() -> None:
    used: set[tuple[str, str, str]] = set()
    problems = [p for rel, tree in _package_files() for p in _violations(rel, tree, used)]
    assert not problems, "string literals naming events / failure kinds in comparisons:\n" + "\n".join(problems)
    assert used == set(NOT_EVENT_NAMES), f"stale NOT_EVENT_NAMES entries: {set(NOT_EVENT_NAMES) - used}"


def test_the_literal_scan_finds_what_it_should() -> None:
    source = '''
TERMINAL = ("requeue", "give_up")
def f(e, kind, m):
    if e.get("event") == "run_complete" or e["event"] in ("launch", "other") or kind != "hang":
        return 1
    if e.get("event") not in {"first_step"} or m == "nan":
        return 2
    match e.get("event"):
        case "give_up":
            return 3
    return "run_complete" if e.get("event") == "not_an_event" else None
'''
    problems = _violations("ckptsup/supervisor/job/attempt.py", ast.parse(source), set())
    assert [p.split(": ", 1)[1].split(" ")[0] for p in problems] == \
        ["'run_complete'", "'launch'", "'hang'", "'first_step'", "'nan'", "'give_up'"]
    assert all(p.startswith("ckptsup/supervisor/job/attempt.py:") for p in problems)


def test_writers_pass_members_not_strings() -> None:
    """`emit(...)` / `make_event(...)` get a member (or a variable holding one), never a string
    literal; a record built by hand ({"event": ...}) names its event through Event too."""
    problems = []
    for rel, tree in _package_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                first = node.args[0]
                if name in ("emit", "make_event") and isinstance(first, (ast.Constant, ast.JoinedStr)):
                    problems.append(f"{rel}:{node.lineno}: {name}({ast.unparse(first)}, …)")
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and key.value == "event" and \
                            isinstance(value, (ast.Constant, ast.JoinedStr)):
                        problems.append(f"{rel}:{node.lineno}: {{'event': {ast.unparse(value)}}}")
    assert not problems, "events written by a string name:\n" + "\n".join(problems)


# ---- the writers refuse names that are not members ----------------------------------------------

def test_make_event_takes_members_and_their_values_and_refuses_the_rest() -> None:
    assert make_event(Event.FR_DUMPED, job_id="1", attempt=0)["event"] == "fr_dumped"
    record = make_event("checkpoint_loaded", job_id="1", attempt=0)  # a forwarded record's name
    assert record["event"] == "checkpoint_loaded" and type(record["event"]) is str
    with pytest.raises(ValueError, match="unknown event name 'checkpoint_exploded'"):
        make_event("checkpoint_exploded", job_id="1", attempt=0)
    for bad in (None, 3, FailureKind.CRASH.name.encode()):
        with pytest.raises(TypeError):
            make_event(bad, job_id="1", attempt=0)  # type: ignore[arg-type]


def test_event_writer_refuses_an_unknown_name_and_writes_nothing(tmp_path: Path) -> None:
    writer = EventWriter(run_dir=tmp_path, job_id="1", attempt=0)
    with pytest.raises(ValueError):
        writer.emit("launched")
    writer.emit(Event.LAUNCH, nodes=["n1"])
    writer.close()
    assert [e["event"] for e in read_events(tmp_path)] == ["launch"]


def test_reporter_checks_the_name_on_every_rank_and_path() -> None:
    from ckptsup.hooks.event_sink import Reporter

    sent: list[tuple[str, dict]] = []
    env = SimpleNamespace(run_dir=None, job_id="1", attempt=0, epoch=1)
    channel = SimpleNamespace(connected=True, send=lambda msg: sent.append((msg.KIND, msg.to_body())))
    Reporter(env=env, rank=0, channel=channel).emit(Event.ELASTIC_RESUME, step=3)
    assert sent[0][0] == "event" and sent[0][1]["record"]["event"] == "elastic_resume"
    for rank in (0, 1):  # rank 1 drops the event, but a bad name is still a bug there
        with pytest.raises(ValueError):
            Reporter(env=env, rank=rank, channel=channel).emit("elastic_resumed", step=3)
    assert len(sent) == 1


def test_parse_maps_names_from_elsewhere_without_raising() -> None:
    assert Event.parse("run_complete") is Event.RUN_COMPLETE
    assert Event.parse(Event.GIVE_UP) is Event.GIVE_UP
    for junk in ("no_such_event", "RUN_COMPLETE", "", None, 7, ["run_complete"], {"a": 1}):
        assert Event.parse(junk) is None


def test_every_hook_event_is_a_member() -> None:
    """The names the hooks emit (through Event members in their source) are all members; a
    rank's fr_dumped record, built by hand, uses the member's value."""
    names = set()
    for path in (PACKAGE / "hooks").glob("*.py"):
        names |= set(re.findall(r"\bEvent\.([A-Z_]+)\b", path.read_text(encoding="utf-8")))
    assert {"CHECKPOINT_LOADED", "ELASTIC_RESUME", "FR_DUMPED", "CHECKPOINT_COMMITTED"} <= names
    assert names <= set(Event.__members__), names - set(Event.__members__)


# ---- members behave as the strings readers see ----------------------------------------------------

def test_members_compare_and_hash_as_their_values() -> None:
    from ckptsup.supervisor.ops import restart_log

    assert {"event": "run_complete"}.get("event") == Event.RUN_COMPLETE
    assert "give_up" in {Event.GIVE_UP} and "node_down" in (FailureKind.NODE_DOWN,)
    assert restart_log.STYLE.get("give_up") == "bold red"
    assert all(isinstance(key, Event) for key in restart_log.STYLE)


def test_reports_show_values_never_member_reprs(tmp_path: Path) -> None:
    """Python 3.11 formats a (str, Enum) member as `Event.X`: no output built from a log written
    with members (and FailureKind fields) may show one."""
    from ckptsup.planning.accounting import account
    from ckptsup.supervisor.ops import restart_log

    writer = EventWriter(run_dir=tmp_path, job_id="7", attempt=0, epoch=1)
    writer.emit(Event.SUPERVISOR_START, script="train.py", resumed=False)
    writer.emit(Event.ALLOCATION, nodes=2, node_names=["n1", "n2"], gpus_per_node=0, spares=0, active=2)
    writer.emit(Event.LAUNCH, nodes=["n1", "n2"], path="initial")
    writer.emit(Event.FIRST_STEP, step=0)
    writer.emit(Event.CHECKPOINT_COMMITTED, step=5, stall_s=0.1, write_s=0.2, bytes=10)
    writer.emit(Event.FAILURE_DETECTED, kind=FailureKind.NODE_DOWN, node="n2", rank=None, step=7, detect_s=1.0)
    writer.emit(Event.GIVE_UP, reason="test", kind=FailureKind.NODE_DOWN)
    writer.close()
    events = read_events(tmp_path)
    assert events[5]["kind"] == "node_down" and type(events[5]["kind"]) is str

    out = io.StringIO()
    restart_log.render(events, Console(file=out, width=200, color_system=None), show_all=True)
    rows = restart_log.rows(events, show_all=True)
    report = json.dumps(account(events).to_dict(price_per_gpu_hour=1.0))
    text = out.getvalue() + "".join(r.event + r.text for r in rows) + report
    assert "Event." not in text and "FailureKind." not in text
    assert [r.event for r in rows][-2:] == ["failure_detected", "give_up"]
    assert "outcome: gave up: test" in out.getvalue() and "node_down x1" in out.getvalue()
    assert restart_log.summarize(events).outcome == "gave up: test"


# ---- docs/contracts.md lists exactly the members ----------------------------------------------------

def _documented_events() -> tuple[list[str], str]:
    text = (ROOT / "docs" / "contracts.md").read_text(encoding="utf-8")
    match = re.search(r"^## Restart log \(`events\.jsonl`, `ckptsup\.events\.Event`\)\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, "docs/contracts.md has no '## Restart log (`events.jsonl`, `ckptsup.events.Event`)' section"
    section = match.group(1)
    return re.findall(r"^\| `([a-z_]+)` \|", section, re.M), section


def test_contracts_md_documents_every_event_and_nothing_else() -> None:
    documented, section = _documented_events()
    assert len(documented) == len(set(documented)), "an event is documented twice"
    members = {e.value for e in Event}
    assert not members - set(documented), f"undocumented events: {sorted(members - set(documented))}"
    assert not set(documented) - members, f"documented but not Event members: {sorted(set(documented) - members)}"
    for kind in FailureKind:
        assert f"`{kind.value}`" in section, f"failure kind {kind.value} not listed in the events section"
