"""Config layering, provenance, refusals and redaction (pure; real TOML files in tmp_path)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptsup.config import REDACTED, load_config, redact
from ckptsup.errors import ConfigError

CKPTSUP = [sys.executable, "-m", "ckptsup.cli"]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def site(tmp_path: Path) -> Path:
    return write(tmp_path / "site.toml", "[checkpoint]\nkeep_last = 5\nsave_every_s = 900\n[cost]\nprice_per_gpu_hour = 3.5\n")


def test_precedence_default_then_site_then_job_then_flag(tmp_path: Path, site: Path) -> None:
    job = write(tmp_path / "job.toml", "[checkpoint]\nkeep_last = 7\n")
    env = {"CKPTSUP_SITE_CONFIG": str(site)}
    resolved = load_config(job_config=job, flags={"checkpoint.keep_last": 9}, env=env)
    assert resolved.config.checkpoint.keep_last == 9
    assert resolved.provenance["checkpoint.keep_last"] == "flag checkpoint.keep_last"
    assert resolved.config.checkpoint.save_every_s == 900.0
    assert resolved.provenance["checkpoint.save_every_s"] == f"site:{site}"
    without_flag = load_config(job_config=job, env=env)
    assert without_flag.config.checkpoint.keep_last == 7
    assert without_flag.provenance["checkpoint.keep_last"] == f"job:{job}"


def test_unset_flag_does_not_override(site: Path) -> None:
    resolved = load_config(flags={"checkpoint.keep_last": None}, env={"CKPTSUP_SITE_CONFIG": str(site)})
    assert resolved.config.checkpoint.keep_last == 5


def test_shipped_default_is_used_without_site_env() -> None:
    resolved = load_config(env={})
    assert resolved.config.checkpoint.keep_last == 3
    assert resolved.provenance["checkpoint.keep_last"].startswith("site:")
    assert resolved.provenance["checkpoint.keep_last"].endswith("default.toml")


def test_integer_for_float_knob_is_accepted_as_float(site: Path) -> None:
    resolved = load_config(env={"CKPTSUP_SITE_CONFIG": str(site)})
    assert isinstance(resolved.config.checkpoint.save_every_s, float)


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[checkpoint]\nkep_last = 3\n", "unknown key checkpoint.kep_last (did you mean keep_last?)"),
        ("[chekpoint]\nkeep_last = 3\n", "unknown section [chekpoint] (did you mean checkpoint?)"),
        ("[checkpoint]\nkeep_last = 0\n", "checkpoint.keep_last = 0 must be >= 1"),
        ("[checkpoint]\nkeep_last = \"3\"\n", "checkpoint.keep_last = '3' must be an integer"),
        ("[checkpoint]\nasync_save = 1\n", "checkpoint.async_save = 1 must be true or false"),
        ("[supervisor]\nkill_grace_s = 0\n", "supervisor.kill_grace_s = 0 must be > 0"),
        ("[supervisor]\nhang_timeout_s = -5\n", "supervisor.hang_timeout_s = -5 must be > 0"),
        ("[supervisor]\nhang_timeout_s = \"soon\"\n", "must be a number of seconds > 0 or \"auto\""),
        ("[storage]\nobject_store = \"gs://bucket/x\"\n", "unknown scheme gs://; valid: s3://"),
        ("[storage]\nnode_local = \"hdfs://x\"\n", "unknown scheme hdfs://"),
        ("[checkpoint]\nhash_algorithm = \"md5\"\n", "must be one of: xxh3-128, crc32, sha256"),
        # the memory tier's replicas and failure domains
        ("[memory]\nreplicas = 4\n", "memory.replicas = 4 must be at most 3"),
        ("[memory]\nreplicas = -1\n", "memory.replicas = -1 must be >= 0"),
        ("[memory]\ndomain_pattern = '^(rack'\n", "memory.domain_pattern = '^(rack' is not a regular expression"),
        ("[memory]\ndomain_pattern = '^(rack)(\\d+)'\n", "must have at most one group (the domain's name), not 2; "
                                                          "make the others non-capturing"),
        ("[checkpoint\nkeep_last = 3\n", "invalid TOML"),
        ("checkpoint = 3\n", "[checkpoint] must be a table of keys"),
        # non-finite and absurd values: each float knob is finite and has an upper bound
        ("[supervisor]\nhang_timeout_s = inf\n", "supervisor.hang_timeout_s = inf must be a finite number"),
        ("[supervisor]\nhang_timeout_s = nan\n", "supervisor.hang_timeout_s = nan must be a finite number"),
        ("[nccl]\ncollective_timeout_s = -inf\n", "nccl.collective_timeout_s = -inf must be a finite number"),
        ("[supervisor]\nkill_grace_s = 1e300\n", "supervisor.kill_grace_s = 1e+300 must be at most 3600"),
        ("[supervisor]\nhang_timeout_s = 1e9\n", "supervisor.hang_timeout_s = 1000000000.0 must be at most 604800"),
        ("[supervisor]\ninit_timeout_s = 604801\n", "supervisor.init_timeout_s = 604801 must be at most 604800"),
        ("[checkpoint]\nemergency_margin = 1e20\n", "checkpoint.emergency_margin = 1e+20 must be at most"),
        ("[cost]\ngpu_mtbf_hours = 1e300\n", "cost.gpu_mtbf_hours = 1e+300 must be at most"),
        # the port gets up to 1999 added per job (placement.rdzv_endpoint)
        ("[supervisor]\nrdzv_port = 99999999\n", "supervisor.rdzv_port = 99999999 must be between 1 and 63536"),
        ("[supervisor]\nrdzv_port = 64000\n", "supervisor.rdzv_port = 64000 must be between 1 and 63536"),
        ("[supervisor]\nrdzv_port = 0\n", "supervisor.rdzv_port = 0 must be between 1 and 63536"),
        # integers: bools are not integers, and no knob takes a figure no site would use
        ("[supervisor]\nnproc_per_node = true\n", "supervisor.nproc_per_node = True must be an integer"),
        ("[supervisor]\nhang_timeout_s = true\n", "supervisor.hang_timeout_s = True must be a number"),
        ("[checkpoint]\nkeep_last = 4611686018427387904\n", "checkpoint.keep_last = 4611686018427387904 must be at most"),
        ("[supervisor]\nnproc_per_node = 1000000\n", "supervisor.nproc_per_node = 1000000 must be at most 4096"),
        ("[nccl]\nflight_recorder_entries = 1000000000000\n", "nccl.flight_recorder_entries = 1000000000000 must be at most"),
        ("[supervisor]\nmax_restarts = 9223372036854775807\n", "supervisor.max_restarts = 9223372036854775807 must be at most"),
        # rules between knobs, checked once every layer is in: both keys named, and the fix
        ("[supervisor]\nlease_stale_s = 1.5\n",
         "supervisor.lease_stale_s = 1.5 (job:"),
        ("[supervisor]\nlease_interval_s = 6\n", "at least 2 x supervisor.lease_interval_s = 6.0 (job:"),
        ("[supervisor]\nnode_silence_s = 0.5\n", "at least 2 x supervisor.heartbeat_interval_s = 1.0"),
        ("[supervisor]\nbackoff_initial_s = 120\n", "supervisor.backoff_max_s = 60.0 (site:"),
        ("[supervisor]\nbackoff_initial_s = 120\n", "at least 1 x supervisor.backoff_initial_s = 120.0 (job:"),
        ("[supervisor]\nheartbeat_interval_s = 3\n",
         "supervisor.node_silence_s = 5.0 (site:"),
    ],
)
def test_bad_values_are_refused_with_file_key_and_fix(tmp_path: Path, toml: str, expected: str) -> None:
    job = write(tmp_path / "job.toml", toml)
    with pytest.raises(ConfigError) as err:
        load_config(job_config=job, env={})
    message = str(err.value)
    assert expected in message
    assert str(job) in message
    assert "\n" not in message


def test_missing_job_config_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(job_config=tmp_path / "nope.toml", env={})


def test_hang_timeout_accepts_auto_and_number(tmp_path: Path) -> None:
    job = write(tmp_path / "job.toml", "[supervisor]\nhang_timeout_s = 45\n")
    assert load_config(job_config=job, env={}).config.supervisor.hang_timeout_s == 45
    assert load_config(env={}).config.supervisor.hang_timeout_s == "auto"


def test_secret_values_never_shown(tmp_path: Path) -> None:
    job = write(tmp_path / "job.toml", "[storage]\ns3_secret_access_key = \"hunter2\"\n")
    resolved = load_config(job_config=job, env={})
    rows = {r["key"]: r["value"] for r in resolved.rows()}
    assert rows["storage.s3_secret_access_key"] == REDACTED
    assert redact({"storage": {"s3_secret_access_key": "hunter2", "s3_region": "x"}}) == {
        "storage": {"s3_secret_access_key": REDACTED, "s3_region": "x"}}
    bad = write(tmp_path / "bad.toml", "[storage]\ns3_secret_access_key = 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(job_config=bad, env={})
    assert "5" not in str(err.value).split("=", 1)[1].split("must")[0]


def test_config_show_cli_prints_provenance_and_redacts(tmp_path: Path, site: Path) -> None:
    job = write(tmp_path / "job.toml", "[storage]\ns3_secret_access_key = \"hunter2\"\n")
    env = {"CKPTSUP_SITE_CONFIG": str(site), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(CKPTSUP + ["config", "show", "--config", str(job), "--json"],
                         capture_output=True, text=True, env=env, check=True).stdout
    rows = {r["key"]: r for r in json.loads(out)}
    assert rows["checkpoint.keep_last"] == {"key": "checkpoint.keep_last", "value": 5, "source": f"site:{site}"}
    assert rows["storage.s3_secret_access_key"]["value"] == REDACTED
    assert "hunter2" not in out
    text = subprocess.run(CKPTSUP + ["config", "show", "--config", str(job)],
                          capture_output=True, text=True, env=env, check=True).stdout
    assert "hunter2" not in text and f"(site:{site})" in text


def test_config_show_bad_toml_is_one_line_exit_2(tmp_path: Path) -> None:
    job = write(tmp_path / "job.toml", "[checkpoint]\nkeep_last = -1\n")
    proc = subprocess.run(CKPTSUP + ["config", "show", "--config", str(job)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "checkpoint.keep_last = -1 must be >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_shipped_default_toml_lists_every_knob() -> None:
    from ckptsup.config import field_help, shipped_default_config

    text = shipped_default_config().read_text()
    for dotted in field_help():
        section, key = dotted.split(".")
        assert f"\n{key} = " in text, f"{dotted} missing from default.toml"


def show(capsys, monkeypatch, site: Path, *args: str) -> str:
    from ckptsup.cli import main

    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site))
    main(["config", "show", *args])
    return capsys.readouterr().out


def test_config_show_prints_the_derived_nccl_settings_and_why_a_timeout_was_lifted(tmp_path: Path, capsys,
                                                                                    monkeypatch) -> None:
    # below the load allowance (600 s) + margin (27 s): docs/timeouts.md §3, which says it is lifted to 627 s
    site = write(tmp_path / "site.toml", "[nccl]\ncollective_timeout_init_s = 600\n")
    out = show(capsys, monkeypatch, site)
    configured, header, derived = out.partition("\nderived by the supervisor")
    assert header, "config show has no derived section"
    assert re.search(r"^nccl\.collective_timeout_init_s\s+600\.0\s", configured, re.M)  # as configured
    for key, value in (("nccl.collective_timeout_init_s (effective)", "627.0"),
                       ("nccl.collective_timeout_s (effective)", "627.0"),   # no step measured: steady = init
                       ("env TORCH_NCCL_ASYNC_ERROR_HANDLING", '"3"'),
                       ("env TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", '"120"'),
                       ("env TORCH_FR_BUFFER_SIZE", '"2000"'),
                       ("env TORCH_FR_DUMP_TEMP_FILE", '"<run_dir>/attempt-0/flight_recorder/rank_"'),
                       ("env CKPTSUP_COLLECTIVE_TIMEOUT_INIT_S", '"627"')):
        assert re.search(rf"^{re.escape(key)}\s+{re.escape(value)}\s", derived, re.M), key
    assert re.search(r'^note\s+"collective_timeout_init_s 600s lifted to 627s', derived, re.M)


def test_config_show_json_has_the_derived_rows_after_the_configured_ones(tmp_path: Path, capsys,
                                                                          monkeypatch) -> None:
    site = write(tmp_path / "site.toml", "[nccl]\ncollective_timeout_init_s = 600\n")
    rows = json.loads(show(capsys, monkeypatch, site, "--json"))
    by_key = {r["key"]: r for r in rows}
    assert by_key["nccl.collective_timeout_init_s"]["value"] == 600.0  # what the site configured
    assert by_key["nccl.collective_timeout_init_s (effective)"]["value"] == 627.0
    assert by_key["env TORCH_NCCL_DUMP_ON_TIMEOUT"]["value"] == "1"
    assert any(r["key"] == "note" and "lifted to 627s" in r["value"] for r in rows)


def test_config_show_lifts_nothing_at_the_shipped_init_timeout(tmp_path: Path, capsys, monkeypatch) -> None:
    site = write(tmp_path / "site.toml", "[nccl]\ncollective_timeout_init_s = 900\n")
    rows = json.loads(show(capsys, monkeypatch, site, "--json"))
    by_key = {r["key"]: r["value"] for r in rows}
    assert by_key["nccl.collective_timeout_init_s (effective)"] == 900.0
    assert not any("lifted" in r["value"] for r in rows if r["key"] == "note")


# ---- h9: bounds, rules between knobs, and the site/job config files as file boundaries --------

def numeric_knobs():
    import dataclasses

    from ckptsup.config import AUTO, SECTIONS

    for section, cls in SECTIONS.items():
        for fld in dataclasses.fields(cls):
            default = fld.default
            if (isinstance(default, (int, float)) and not isinstance(default, bool)) or default == AUTO \
                    and fld.name.endswith("_s"):
                yield section, fld


def test_every_numeric_knob_has_an_upper_bound_no_site_would_exceed() -> None:
    missing = [f"{s}.{f.name}" for s, f in numeric_knobs() if f.metadata.get("max") is None]
    assert not missing, f"knobs without an upper bound: {missing}"
    for section, fld in numeric_knobs():
        if fld.name.endswith("_s"):
            assert fld.metadata["max"] <= 7 * 86400, f"{section}.{fld.name}: no timeout is longer than 7 days"


def test_every_knob_at_its_upper_bound_still_derives_finite_timeouts(tmp_path: Path) -> None:
    """The bounds are what keeps the derivation (sums, int() of seconds, ports + spread) finite."""
    from ckptsup.supervisor.job import nccl

    lines: dict[str, list[str]] = {}
    for section, fld in numeric_knobs():
        if section == "supervisor" and fld.name in ("lease_interval_s", "heartbeat_interval_s"):
            continue  # bounded by the rules between knobs instead (stale / silence >= 2 x)
        if fld.name == "async_error_handling":
            continue
        lines.setdefault(section, []).append(f"{fld.name} = {fld.metadata['max']}")
    job = write(tmp_path / "max.toml", "".join(f"[{s}]\n" + "\n".join(v) + "\n" for s, v in lines.items()))
    config = load_config(job_config=job, env={}).config
    env = nccl.nccl_env(config, run_dir=tmp_path, attempt=0, step_times=[1e5], save_times=[1e5])
    assert all(value.lstrip("-").replace(".", "", 1).isdigit() for value in env.values() if value[:1].isdigit())
    assert config.supervisor.rdzv_port + 1999 <= 65535


def test_shipped_default_toml_is_generated_from_the_schema() -> None:
    """site_config/default.toml is `render_default_toml()`; regenerate it with
    `python -c 'from ckptsup.config import render_default_toml as r; print(r(), end="")' > site_config/default.toml`."""
    from ckptsup.config import render_default_toml, shipped_default_config

    assert shipped_default_config().read_text() == render_default_toml()


def test_config_show_notes_name_the_configured_hang_timeout_that_lifted_the_collective_timeouts(
        tmp_path: Path, capsys, monkeypatch) -> None:
    # docs/timeouts.md §3: a configured value that would break the ordering is lifted, with a note
    site = write(tmp_path / "site.toml", "[supervisor]\nhang_timeout_s = 5000\n[nccl]\ncollective_timeout_s = 60\n")
    rows = json.loads(show(capsys, monkeypatch, site, "--json"))
    by_key = {r["key"]: r for r in rows}
    assert by_key["supervisor.hang_timeout_s (effective)"]["value"] == 5000.0
    assert "configured" in by_key["supervisor.hang_timeout_s (effective)"]["source"]
    assert by_key["nccl.collective_timeout_s (effective)"]["value"] == 5027.0
    assert by_key["nccl.collective_timeout_init_s (effective)"]["value"] == 5027.0
    notes = [r["value"] for r in rows if r["key"] == "note"]
    assert any(n.startswith("collective_timeout_s 60s lifted to 5027s") and "hang timeout" in n for n in notes), notes
    assert any(n.startswith("collective_timeout_init_s 900s lifted to 5027s") and "hang timeout (5000s)" in n
               for n in notes), notes
    text = show(capsys, monkeypatch, site)
    assert re.search(r'^note\s+"collective_timeout_init_s 900s lifted to 5027s', text, re.M)


def _fifo(path: Path) -> Path:
    import os

    os.mkfifo(path)
    return path


@pytest.mark.parametrize(("make", "needle"), [
    (lambda p: p.mkdir() or p, "is a directory, not a regular file"),
    (lambda p: Path("/dev/zero"), "is a character device, not a regular file"),
    (_fifo, "is a FIFO, not a regular file"),
    (lambda p: write(p, "# " + "x" * (1 << 20) + "\n"), "at most 1048576 are read"),
    (lambda p: write(p, "a = " + "[" * 100_000 + "]" * 100_000 + "\n"), "invalid TOML"),
    (lambda p: p.with_name("missing.toml"), "does not exist"),
])
@pytest.mark.parametrize("role", ["site", "job"])
def test_a_config_path_that_is_not_a_toml_file_is_one_line(tmp_path: Path, make, needle: str, role: str) -> None:
    path = make(tmp_path / "cfg.toml")
    kwargs = {"env": {"CKPTSUP_SITE_CONFIG": str(path)}} if role == "site" else {"job_config": path, "env": {}}
    with pytest.raises(ConfigError) as err:
        load_config(**kwargs)
    message = str(err.value)
    assert needle in message and str(path) in message and "\n" not in message
    assert f"{role} config" in message or "invalid TOML" in message
    if role == "site" and needle != "invalid TOML":
        assert "CKPTSUP_SITE_CONFIG" in message  # where the path came from


def test_a_config_may_be_a_symlink_to_the_file(tmp_path: Path) -> None:
    real = write(tmp_path / "real.toml", "[checkpoint]\nkeep_last = 6\n")
    (tmp_path / "link.toml").symlink_to(real)
    assert load_config(env={"CKPTSUP_SITE_CONFIG": str(tmp_path / "link.toml")}).config.checkpoint.keep_last == 6
    assert load_config(job_config=tmp_path / "link.toml", env={}).config.checkpoint.keep_last == 6


def test_rules_between_knobs_are_also_checked_in_the_supervisors_effective_config(tmp_path: Path) -> None:
    from ckptsup.config import read_config_json

    path = write(tmp_path / "config.json", json.dumps({"config": {"supervisor": {"lease_stale_s": 1.0}}}))
    with pytest.raises(ConfigError, match=r"lease_stale_s = 1.0 \(supervisor:.*at least 2 x supervisor.lease_interval_s"):
        read_config_json(path)
    _fifo(tmp_path / "fifo.json")
    with pytest.raises(ConfigError, match="is a FIFO"):
        read_config_json(tmp_path / "fifo.json")


@pytest.mark.parametrize("pattern", ["", r"^(rack\d+)-", r"^nvl\d+", r"^(?:gpu)(\d+)"])
def test_a_domain_pattern_of_one_group_or_none_is_accepted(tmp_path: Path, pattern: str) -> None:
    job = write(tmp_path / "job.toml", f"[memory]\nreplicas = 2\ndomain_pattern = '{pattern}'\n")
    memory = load_config(job_config=job, env={}).config.memory
    assert (memory.replicas, memory.domain_pattern) == (2, pattern)


def test_set_explicitly_tells_a_users_value_from_the_built_in_and_shipped_defaults(tmp_path: Path) -> None:
    from ckptsup.config import set_explicitly, shipped_default_config

    key = "memory.every_steps"
    shipped = load_config(env={"CKPTSUP_SITE_CONFIG": str(shipped_default_config())})
    assert shipped.provenance[key].startswith("site:") and not set_explicitly(shipped.provenance, key)
    # the same file by another path (the repo's site_config/, which the package links to)
    repo_copy = Path(__file__).resolve().parents[1] / "site_config" / "default.toml"
    assert not set_explicitly(load_config(env={"CKPTSUP_SITE_CONFIG": str(repo_copy)}).provenance, key)
    assert not set_explicitly({}, key) and not set_explicitly({key: "default"}, key)
    site = write(tmp_path / "site.toml", "[memory]\nevery_steps = 10\n")   # the default's figure, but chosen
    job = write(tmp_path / "job.toml", "[memory]\nevery_steps = 7\n")
    env = {"CKPTSUP_SITE_CONFIG": str(site)}
    assert set_explicitly(load_config(env=env).provenance, key)
    assert set_explicitly(load_config(job_config=job, env={}).provenance, key)
    assert set_explicitly(load_config(flags={key: 5}, env={}).provenance, key)
    assert not set_explicitly(load_config(env=env).provenance, "memory.keep")   # the site file did not set it
