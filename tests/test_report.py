"""`ckptsup report RUN_DIR`: terminal, --json, --png, --html and --prom on a hand-written run."""

import base64
import json
import re

import pytest

from ckptsup.cli import main
from ckptsup.events import EVENTS_FILE
from test_accounting import EXPECTED, PAID, faulted_run


@pytest.fixture()
def run_dir(tmp_path, monkeypatch):
    site = tmp_path / "site.toml"
    site.write_text("[cost]\nprice_per_gpu_hour = 4.0\ngpu_mtbf_hours = 20000.0\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site))
    rd = tmp_path / "run"
    rd.mkdir(mode=0o700)
    (rd / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in faulted_run()))
    return rd


def run_cli(capsys, *args):
    code = 0
    try:
        main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report_has_goodput_badput_and_the_recommended_interval(capsys, run_dir):
    code, out, err = run_cli(capsys, "report", str(run_dir), "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["paid_device_hours"] == pytest.approx(PAID / 3600)
    assert rep["useful_device_hours"] == pytest.approx(EXPECTED["useful"] / 3600)
    total = rep["useful_device_hours"] + sum(rep["badput_device_hours"].values())
    assert total == pytest.approx(rep["paid_device_hours"])
    assert rep["price_per_gpu_hour"] == 4.0
    assert rep["paid_usd"] == pytest.approx(PAID / 3600 * 4.0)
    assert rep["queue_s"] == pytest.approx(300)
    assert rep["observed_job_mtbf_s"] == pytest.approx(1230)  # one crash in 1230 s; the preemption does not count
    assert rep["recommended"]["interval_daly_s"] > 0
    assert rep["job_id"] == "J1"


def test_terminal_summary_lists_categories_and_measurements(capsys, run_dir):
    code, out, _ = run_cli(capsys, "report", str(run_dir))
    assert code == 0
    for text in ("goodput", "lost progress", "checkpoint stall", "idle spares", "restart: load",
                 "observed job MTBF", "interval plan recommends now", "queue"):
        assert text in out


def test_memory_save_stalls_are_their_own_priced_line_and_the_memory_interval_is_shown(capsys, tmp_path, monkeypatch):
    from test_accounting import ev, with_memory_saves

    site = tmp_path / "site.toml"
    site.write_text("[cost]\nprice_per_gpu_hour = 4.0\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site))
    monkeypatch.setenv("COLUMNS", "200")   # one summary row a line
    events = with_memory_saves()
    events.insert(-1, ev(1500, "interval_changed", level="memory", every_steps=7, interval_s=70.0,
                         why="memory_saved: C_m=1s", attempt=2, mono_base=50_000.0 - 1230))
    rd = tmp_path / "run"
    rd.mkdir(mode=0o700)
    (rd / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    code, out, err = run_cli(capsys, "report", str(rd), "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["badput_usd"]["memory_stall"] == pytest.approx(5.5 * 8 / 3600 * 4.0)
    assert rep["memory_intervals_changed"] == [[1500.0, 7.0, 70.0, "memory_saved: C_m=1s"]]
    assert rep["intervals_changed"] == []            # the disk interval's list holds disk changes only
    code, out, _ = run_cli(capsys, "report", str(rd))
    assert code == 0
    [line] = [row for row in out.splitlines() if "memory save stall" in row]
    assert "$0.05" in line                                      # 44 device-s at $4/device-h
    assert "memory saves" in out and "adaptive interval 7 steps" in out
    code, out, _ = run_cli(capsys, "report", str(rd), "--prom", str(tmp_path / "x.prom"))
    assert 'category="memory_stall"' in (tmp_path / "x.prom").read_text()


def test_png_is_a_real_png_with_a_timeline(capsys, run_dir, tmp_path):
    target = tmp_path / "report.png"
    code, _, err = run_cli(capsys, "report", str(run_dir), "--png", str(target))
    assert code == 0, err
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_html_is_one_self_contained_page(capsys, run_dir, tmp_path):
    target = tmp_path / "report.html"
    code, _, err = run_cli(capsys, "report", str(run_dir), "--html", str(target))
    assert code == 0, err
    page = target.read_text()
    match = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert match and base64.b64decode(match.group(1))[:4] == b"\x89PNG"
    assert "lost progress" in page and "<table>" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere


def test_prom_textfile_is_valid_exposition_format(capsys, run_dir, tmp_path):
    target = tmp_path / "ckptsup.prom"
    code, _, err = run_cli(capsys, "report", str(run_dir), "--prom", str(target))
    assert code == 0, err
    text = target.read_text()
    sample = re.compile(r'^ckptsup_[a-z_]+\{job_id="J1"(,[a-z]+="[^"]*")*\} -?[0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    assert 'ckptsup_badput_device_hours{job_id="J1",category="lost_progress"}' in text
    value = float(re.search(r"^ckptsup_goodput_ratio\{[^}]*\} (\S+)$", text, re.M).group(1))
    assert value == pytest.approx(EXPECTED["useful"] / PAID)


def test_missing_run_dir_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "report", str(tmp_path / "nope"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0]


def test_dir_without_events_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "report", str(tmp_path))
    assert code == 2 and "events.jsonl" in err and len(err.strip().splitlines()) == 1


def test_unwritable_output_is_one_line(capsys, run_dir, tmp_path):
    code, _, err = run_cli(capsys, "report", str(run_dir), "--png", str(tmp_path / "missing-dir" / "x.png"))
    assert code == 2 and "cannot write" in err and len(err.strip().splitlines()) == 1


def short_run():
    """A 40 s run: one attempt, a few steps, one checkpoint."""
    from test_accounting import ev

    a1 = dict(attempt=1, mono_base=1000.0)
    return [
        ev(0, "supervisor_start", **a1),
        ev(0, "allocation", nodes=1, gpus_per_node=4, spares=0, **a1),
        ev(0, "launch", nodes=1, path="initial", **a1),
        ev(5, "first_step", step=0, **a1),
        ev(20, "step_progress", step=9, step_time_s=1.5, **a1),
        ev(22, "checkpoint_committed", step=10, stall_s=1.0, write_s=1.0, bytes=1_000, **a1),
        ev(38, "step_progress", step=19, step_time_s=1.5, **a1),
        ev(40, "run_complete", **a1),
    ]


@pytest.fixture()
def rendered(monkeypatch):
    """The figures `ckptsup report --png` saves, to read the axes the code set."""
    from matplotlib.figure import Figure

    figures = []
    savefig = Figure.savefig

    def spy(fig, *args, **kwargs):
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


@pytest.mark.parametrize("span_s, unit", [(0.0, "s"), (40.0, "s"), (119.0, "s"), (121.0, "min"),
                                          (1530.0, "min"), (7199.0, "min"), (7201.0, "h"), (3 * 86400.0, "h")])
def test_time_axis_unit_follows_the_span(span_s, unit):
    from ckptsup.planning.goodput_report import time_axis_unit

    name, seconds = time_axis_unit(span_s)
    assert name == unit
    assert seconds == {"s": 1.0, "min": 60.0, "h": 3600.0}[unit]


def test_png_of_a_40s_run_has_its_time_axis_in_seconds(capsys, tmp_path, rendered):
    rd = tmp_path / "run"
    rd.mkdir(mode=0o700)
    (rd / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in short_run()))
    target = tmp_path / "short.png"
    code, _, err = run_cli(capsys, "report", str(rd), "--png", str(target))
    assert code == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = rendered
    timeline = fig.axes[0]
    assert timeline.get_xlabel() == "wall time since first event (s)"
    steps = timeline.get_lines()[0]
    assert max(steps.get_xdata()) == pytest.approx(38.0)  # the values are in seconds too, not 38/3600


def test_png_of_a_25_minute_run_reads_in_minutes(capsys, run_dir, tmp_path, rendered):
    code, _, err = run_cli(capsys, "report", str(run_dir), "--png", str(tmp_path / "long.png"))
    assert code == 0, err
    (fig,) = rendered
    assert fig.axes[0].get_xlabel() == "wall time since first event (min)"
    assert max(fig.axes[0].get_lines()[0].get_xdata()) == pytest.approx(1525 / 60)


def test_loads_are_counted_by_source_and_old_logs_count_as_shared():
    from ckptsup.planning.goodput_report import loads_by_source

    events = [
        {"event": "checkpoint_loaded", "load_s": 2.0, "files_by_source": {"memory": 0, "peer_memory": 0, "node_local": 2,
                                                                           "shared": 2, "object": 0}},
        {"event": "checkpoint_loaded", "load_s": 9.5, "files_by_source": {"object": 4, "shared": 0}},
        {"event": "checkpoint_loaded", "load_s": 1.5, "read_shared_files": 4, "read_local_files": 0},   # before files_by_source
        {"event": "checkpoint_loaded", "load_s": "x", "files_by_source": {"shared": "2", 3: 1}},      # hostile: ignored
        {"event": "checkpoint_committed", "load_s": 100.0, "files_by_source": {"shared": 9}},
    ]
    assert loads_by_source(events) == {
        "node_local": {"loads": 1, "files": 2, "load_s": 2.0},
        "shared": {"loads": 2, "files": 6, "load_s": 3.5},
        "object": {"loads": 1, "files": 4, "load_s": 9.5},
    }


def test_the_report_shows_load_time_by_source(capsys, run_dir):
    events = run_dir / EVENTS_FILE
    last = json.loads(events.read_text().splitlines()[-1])
    record = {**{k: last[k] for k in ("ts", "mono", "job_id", "attempt")}, "event": "checkpoint_loaded",
              "step": 5, "load_s": 3.25, "files_by_source": {"object": 4}}
    events.write_text(events.read_text() + json.dumps(record) + "\n")
    code, out, _ = run_cli(capsys, "report", str(run_dir), "--json")
    assert code == 0 and json.loads(out)["loads_by_source"]["object"] == {"loads": 1, "files": 4, "load_s": 3.25}
    code, out, _ = run_cli(capsys, "report", str(run_dir))
    assert code == 0 and "checkpoint loads by source" in out and "object 1 (4 files" in out
