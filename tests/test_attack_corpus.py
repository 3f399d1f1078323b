"""The attack corpus (issue 9, "Every case that broke", plus what the fuzz tier found): one table,
CORPUS, of every concrete hostile or clumsy input reachable without a real Slurm cluster or a
multi-process torch run, the promise it must keep, and the tests that pin it.

Most cases already have a test where their boundary is tested (tests/test_cli_bad_inputs.py,
test_checkpoint_hostile.py, ...): the corpus names them instead of repeating them, and
`test_the_case_is_pinned` fails when a named test (or its parameter id) disappears. The cases no
other file covers are tested here (`test_corpus_*`). SECURITY.md's table of attack classes is
this table counted (`test_security_md_counts_the_corpus`)."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CKPTSUP = str(Path(sys.executable).with_name("ckptsup"))
SECURITY_MD = ROOT / "SECURITY.md"
ONE_LINE = "one line, no traceback"


@dataclass(frozen=True)
class Case:
    id: str
    attack: str                # the class, as SECURITY.md's table names it
    case: str                  # the input
    promise: str               # what must happen
    pins: tuple[str, ...]      # "file.py::test_name" or "file.py::test_name[parameter id]"


C = Case
BAD = "test_cli_bad_inputs.py::test_bad_input_is_one_error_line_naming_the_problem"
SITE = "test_cli_bad_inputs.py::test_a_bad_site_config_is_one_error_line"
HOSTILE_CLI = "test_checkpoint_hostile.py::test_every_ckpt_command_answers_a_hostile_newest_checkpoint_in_one_line"
HOSTILE_PICK = "test_checkpoint_hostile.py::test_the_supervisor_resumes_from_the_older_good_checkpoint_past_a_hostile_newest"
HOSTILE_RETENTION = "test_checkpoint_hostile.py::test_retention_skips_a_hostile_newest_checkpoint"

CORPUS: tuple[Case, ...] = (
    # ---- config knobs ----
    C("hang-timeout-inf", "config knobs", "hang_timeout_s = inf (config show, launch)",
      f"refused at load, {ONE_LINE}, exit 2", (f"{BAD}[config-hang-timeout-inf]", f"{BAD}[launch-hang-timeout-inf]")),
    C("kill-grace-1e300", "config knobs", "kill_grace_s = 1e300", f"refused at load (at most 3600), {ONE_LINE}",
      (f"{BAD}[config-kill-grace-huge]", f"{BAD}[launch-kill-grace-huge]")),
    C("rdzv-port-huge", "config knobs", "rdzv_port = 99999999", "refused: between 1 and 63536",
      (f"{BAD}[config-rdzv-port-huge]",)),
    C("lease-rule", "config knobs", "lease_stale_s < 2 x lease_interval_s", "refused naming both keys and sources",
      (f"{BAD}[config-lease-stale-below-twice-the-interval]",
       "test_config.py::test_rules_between_knobs_are_also_checked_in_the_supervisors_effective_config")),
    C("silence-rule", "config knobs", "node_silence_s below 2 heartbeats", "refused naming both keys",
      (f"{BAD}[config-node-silence-below-two-heartbeats]",)),
    C("hang-above-collective", "config knobs", "a hang timeout far above the collective timeout",
      "config show says which configured knob lifted the collective timeouts",
      ("test_config.py::test_config_show_notes_name_the_configured_hang_timeout_that_lifted_the_collective_timeouts",)),
    # ---- site config ----
    C("site-config-dir", "site config", "CKPTSUP_SITE_CONFIG is a directory", f"{ONE_LINE}, exit 2",
      (f"{SITE}[site-config-is-a-dir]",)),
    C("site-config-dev-zero", "site config", "CKPTSUP_SITE_CONFIG=/dev/zero", f"no read without bound, {ONE_LINE}",
      (f"{SITE}[site-config-dev-zero]",)),
    C("site-config-fifo", "site config", "CKPTSUP_SITE_CONFIG is a FIFO", f"never blocks, {ONE_LINE}",
      (f"{SITE}[site-config-fifo]",)),
    # ---- run dir ----
    C("state-json-list", "run dir", "state.json is []", f"{ONE_LINE} naming the fix, exit 2",
      (f"{BAD}[launch-state-json-a-list]", "test_rundir_state.py::test_a_state_json_of_the_wrong_shape_or_types_is_one_line")),
    C("state-json-epoch-str", "run dir", 'state.json is {"epoch": "x"}', f"{ONE_LINE}, exit 2",
      (f"{BAD}[launch-state-json-epoch-a-string]",)),
    C("secret-empty", "run dir", "an empty 0600 secret file", "refused, never the key b''",
      ("test_rundir_state.py::test_a_secret_that_is_not_a_ckptsup_key_is_refused",
       "test_rank_channel_start.py::test_an_empty_or_short_secret_is_refused_not_used_as_the_key")),
    # ---- rank environment ----
    C("rank-socket-missing", "rank environment", "CKPTSUP_RANK_SOCKET names a missing file",
      "one ConfigError line naming the variable",
      ("test_rank_channel_start.py::test_a_missing_socket_is_one_line_naming_the_variable",)),
    C("secret-file-missing", "rank environment", "CKPTSUP_SECRET_FILE names a missing file",
      "one ConfigError line naming the variable",
      ("test_rank_channel_start.py::test_a_missing_secret_file_is_one_line_naming_the_variable",)),
    # ---- restart log ----
    C("event-a-list", "restart log", "an event whose `event` is a list (log, report, ops)",
      "the line is skipped and counted, no TypeError",
      ("test_events_readers.py::test_parse_line_refuses_non_names_deep_and_huge_lines_without_raising",
       "test_events_readers.py::test_rows_of_records_whose_event_is_not_a_name_render")),
    C("naive-aware-ts", "restart log", "naive and aware timestamps mixed", "both read as UTC, no TypeError",
      ("test_events_readers.py::test_rows_and_summary_mix_naive_and_aware_timestamps_as_utc",
       "test_events_readers.py::test_report_of_mixed_timestamps_counts_wall_clock_as_utc")),
    C("deep-event-line", "restart log", "a 100,000-deep JSON line", "skipped, no RecursionError",
      ("test_events_readers.py::test_parse_line_refuses_non_names_deep_and_huge_lines_without_raising",
       "test_fuzz_events.py::test_parse_line_bounds_nesting_and_numbers")),
    C("events-jsonl-dir", "restart log", "events.jsonl is a directory (log, report, ops)", ONE_LINE,
      (f"{BAD}[report-log-is-a-directory]",
       "test_events_readers.py::test_a_restart_log_that_is_a_directory_is_one_line_for_every_reader",
       "test_events_readers.py::test_requeue_with_a_restart_log_that_is_a_directory_is_one_line")),
    # ---- checkpoint CLI ----
    C("fifo-manifest", "checkpoint CLI", "a FIFO manifest.json (ckpt inspect|verify|list|prune)",
      f"never blocks, {ONE_LINE}", (f"{HOSTILE_CLI}[fifo_manifest]", f"{HOSTILE_RETENTION}[fifo_manifest]")),
    C("fifo-validation", "checkpoint CLI", "a FIFO validation.json", "read as not validated, never blocks",
      (f"{HOSTILE_CLI}[fifo_validation]",)),
    C("validation-dev-zero", "checkpoint CLI", "validation.json -> /dev/zero", "not followed, no MemoryError",
      (f"{HOSTILE_CLI}[validation_to_dev_zero]",)),
    C("validation-level-x", "checkpoint CLI", 'validation.json with "level": "x"', "read as not validated",
      (f"{HOSTILE_CLI}[validation_level_x]",)),
    C("surrogate-path", "checkpoint CLI", "a path with a lone surrogate", f"{ONE_LINE}, exit 1",
      ("test_checkpoint_hostile.py::test_a_path_with_a_lone_surrogate_is_one_line", f"{HOSTILE_CLI}[surrogate_file_name]")),
    C("size-10e400", "checkpoint CLI", "a size of 10^400 in a manifest", "the manifest is refused, no OverflowError",
      (f"{HOSTILE_CLI}[size_10e400]", f"{HOSTILE_CLI}[item_offset_10e400]")),
    C("not-step-n", "checkpoint CLI", "a directory not named step_N holding a manifest", f"{ONE_LINE}, exit 1",
      ("test_checkpoint_hostile.py::test_a_directory_not_named_step_n_holding_a_manifest_is_one_line",)),
    C("created-year-1-9999", "checkpoint CLI", "created_at in year 1 or 9999", "the manifest is refused, no OverflowError",
      (f"{HOSTILE_CLI}[created_year_1]", f"{HOSTILE_CLI}[created_year_9999]")),
    C("keep-daily-1e20", "checkpoint CLI", "prune --keep-daily-days 1e20", "an answer or one usage line",
      ("test_checkpoint_hostile.py::test_prune_with_an_absurd_number_of_daily_days_is_an_answer_or_one_line",
       "test_checkpoint_hostile.py::test_daily_keepers_take_any_number_of_days_and_any_representable_date")),
    C("agent-spec", "checkpoint CLI", "a malformed hidden `ckptsup agent` spec", f"{ONE_LINE}, exit 2",
      ("test_cli_bad_inputs.py::test_a_bad_agent_spec_is_one_error_line_and_exit_2",
       "test_launch_spec.py::test_a_bad_spec_is_one_line_naming_the_field")),
    # ---- resume ----
    C("metadata-side-effect", "resume", "a crafted .metadata naming an allow-listed DCP class with side effects",
      "refused before it runs; quarantined, the resume falls back to the older checkpoint",
      ("test_hooks_metadata.py::test_dcp_classes_with_side_effects_are_refused_before_they_run",
       "test_hooks_metadata.py::test_a_crafted_metadata_is_quarantined_and_resume_falls_back_to_the_older_checkpoint"
       "[side-effect]",
       "test_hooks_metadata.py::test_an_unpickled_object_that_is_not_dcp_metadata_is_a_validation_failure")),
    C("resume-surrogate", "resume", "a surrogate path in the newest checkpoint", "resumes from the older one, no traceback",
      (f"{HOSTILE_PICK}[surrogate_file_name]",)),
    C("group-writable-file", "resume", "one group-writable file in the newest checkpoint",
      "skipped with the fix, nothing quarantined",
      ("test_checkpoint_trust_resume.py::test_a_group_writable_file_in_the_newest_skips_it_without_quarantine",)),
    C("ckpt-dir-other-owner", "resume", "the checkpoint dir owned by another user", "stops with the fix, nothing quarantined",
      ("test_checkpoint_trust_resume.py::test_a_checkpoint_dir_owned_by_another_user_stops_with_the_fix",
       "test_checkpoint_trust_resume.py::test_a_checkpoint_dir_chowned_recursively_quarantines_nothing")),
    C("resume-fifo-manifest", "resume", "a FIFO step_N/manifest.json", "never blocks; resumes from the older one",
      (f"{HOSTILE_PICK}[fifo_manifest]",
       "test_checkpoint_hostile.py::test_a_fifo_manifest_does_not_block_the_resume_choice_of_an_already_validated_run")),
    # ---- rank socket ----
    C("connect-close", "rank socket", "connect and close without data, x20", "no rank, no restart, one log line",
      ("test_agent_boundary.py::test_connections_that_close_without_an_authenticated_hello_are_no_rank_and_change_nothing",)),
    C("one-mb-line", "rank socket", "a 1 MB line without a newline", "dropped, no rank, no restart",
      ("test_agent_boundary.py::test_connections_that_close_without_an_authenticated_hello_are_no_rank_and_change_nothing",
       "test_fuzz_wire.py::test_an_unterminated_flood_is_one_frame_error")),
    C("replay-new-connection", "rank socket", "a valid frame replayed on a new connection", "dropped",
      ("test_agent_boundary.py::test_a_valid_frame_replayed_on_a_new_connection_is_dropped",)),
    C("nested-brackets", "rank socket", "a 2 KB nested-bracket line without MAC", "dropped before json.loads",
      ("test_agent_boundary.py::test_deep_brackets_without_a_mac_do_not_reach_the_json_parser",
       "test_fuzz_wire.py::test_deep_nesting_surrogate_strs_and_non_hex_macs_are_frame_errors")),
    # ---- signals ----
    C("sighup", "signals", "SIGHUP to the supervisor", "a stop event, state stopped, exit PREEMPTED",
      ("test_supervisor_loop.py::test_a_hangup_to_the_supervisor_stops_it_like_a_preemption",)),
    # ---- found by the fuzz tier ----
    C("int-choice-knob", "found by the fuzz tier", "[nccl] async_error_handling = 5", f"{ONE_LINE}, exit 2 (was a TypeError)",
      ("test_fuzz_config.py::test_an_integer_choice_out_of_range_is_one_line_not_a_type_error",
       "test_attack_corpus.py::test_corpus_config_inputs_the_fuzz_tier_found[int-choice-knob]")),
    C("toml-key-line-break", "found by the fuzz tier", 'a quoted TOML section or key holding a line break (["a\\nb"])',
      "named on one line (was two)",
      ("test_fuzz_config.py::test_a_quoted_section_or_key_with_a_line_break_is_named_on_one_line",
       "test_attack_corpus.py::test_corpus_config_inputs_the_fuzz_tier_found[toml-key-line-break]")),
    C("spec-port-digits", "found by the fuzz tier", "an agent spec endpoint 'h:²' or a 5,000-digit port",
      f"{ONE_LINE}, exit 2 (was a ValueError traceback)",
      ("test_fuzz_launch_spec.py::test_an_endpoint_with_a_non_ascii_digit_port_is_one_line_not_a_value_error",
       "test_attack_corpus.py::test_corpus_agent_specs_the_fuzz_tier_found[spec-port-digits]")),
    C("spec-field-line-break", "found by the fuzz tier", "an agent spec field named 'a\\nb'", "named on one line",
      ("test_fuzz_launch_spec.py::test_an_unknown_field_of_any_name_is_named_on_one_line",
       "test_attack_corpus.py::test_corpus_agent_specs_the_fuzz_tier_found[spec-field-line-break]")),
    C("file-name-line-break", "found by the fuzz tier", "a file named 'x\\nckptsup: error: ...' in a checkpoint",
      "ckpt verify reports it on one line: no forged output line",
      ("test_fuzz_checkpoint.py::test_a_file_name_with_a_line_break_in_a_checkpoint_is_reported_on_one_line",
       "test_attack_corpus.py::test_corpus_a_file_name_cannot_forge_a_line_of_ckpt_verify")),
    C("manifest-long-names", "found by the fuzz tier", "unknown manifest fields of 100,000 characters or with line "
      "breaks, 4,000-digit numbers", "named short, on one line",
      ("test_fuzz_checkpoint.py::test_unknown_manifest_fields_and_huge_numbers_are_named_short_on_one_line",)),
    C("metadata-huge-length", "found by the fuzz tier", "a 12-byte .metadata claiming a 2**40-byte object",
      "a validation failure: the resume falls back (was a MemoryError crash)",
      ("test_fuzz_metadata.py::test_a_length_past_the_end_of_the_data_is_a_validation_failure_not_a_memory_error",
       "test_attack_corpus.py::test_corpus_a_metadata_claiming_a_huge_length_falls_back_to_the_older_checkpoint")),
    C("float-knob-huge-int", "found by the fuzz tier", "save_every_s = 999...9 (a 400-digit TOML integer)",
      f"{ONE_LINE}, exit 2 (was an OverflowError traceback of every command)",
      ("test_fuzz_config.py::test_an_integer_past_a_float_for_a_seconds_knob_is_one_line_not_an_overflow",
       "test_attack_corpus.py::test_corpus_config_inputs_the_fuzz_tier_found[float-knob-huge-int]")),
    C("spec-seconds-huge-int", "found by the fuzz tier", "an agent spec kill_grace_s of 10**400",
      f"{ONE_LINE}, exit 2 (was an OverflowError traceback)",
      ("test_fuzz_launch_spec.py::test_a_number_of_seconds_past_any_float_is_one_line_not_an_overflow",
       "test_attack_corpus.py::test_corpus_agent_specs_the_fuzz_tier_found[spec-seconds-huge-int]")),
    C("state-huge-int", "found by the fuzz tier", "10**400 as a measurement or detect_s in state.json, as a "
      "lease's renewed", "dropped / one line / no lease (was an OverflowError traceback)",
      ("test_fuzz_rundir.py::test_integers_past_any_float_in_state_json_and_the_lease_are_no_overflow",
       "test_attack_corpus.py::test_corpus_a_state_json_with_a_number_past_any_float_is_one_line")),
    C("mac-non-ascii", "found by the fuzz tier", 'a frame whose "mac" is a non-ASCII string, on the rank socket',
      "dropped and counted (a TypeError of hmac.compare_digest out of decode before the MAC was checked as hex)",
      ("test_fuzz_wire.py::test_deep_nesting_surrogate_strs_and_non_hex_macs_are_frame_errors",)),
    C("frame-kind-surrogate", "found by the fuzz tier", 'a frame {"m": "\\ud800", ...} on the rank socket',
      "dropped and counted (was a UnicodeEncodeError out of decode: the agent died)",
      ("test_fuzz_wire.py::test_a_kind_holding_a_lone_surrogate_is_a_frame_error_not_a_unicode_error",
       "test_attack_corpus.py::test_corpus_a_frame_kind_with_a_lone_surrogate_is_dropped_by_the_reader")),
)

CLASSES = tuple(dict.fromkeys(case.attack for case in CORPUS))


# ---- the index -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CORPUS, ids=[c.id for c in CORPUS])
def test_the_case_is_pinned(case: Case) -> None:
    """Every pin names a test that exists, with its parameter id when it has one."""
    missing = []
    for pin in case.pins:
        match = re.fullmatch(r"(test_\w+\.py)::(test_\w+)(?:\[(.+)\])?", pin)
        assert match, f"malformed pin {pin!r}"
        name, func, param = match.groups()
        path = TESTS / name
        text = path.read_text() if path.exists() else ""
        if not re.search(rf"^(?:async )?def {func}\(", text, re.M):
            missing.append(pin)
            continue
        assert param is None or param in text, f"{pin}: no parameter id {param!r} in {name}"
    assert not missing, f"pinned by tests that do not exist: {missing}"


def test_security_md_counts_the_corpus() -> None:
    """SECURITY.md's table has one row per attack class with this table's count of cases."""
    text = SECURITY_MD.read_text()
    rows = {m.group(1).strip(): int(m.group(2)) for m in
            re.finditer(r"^\|\s*([^|]+?)\s*\|\s*(\d+)\s*\|", text, re.M)}
    assert {cls: rows.get(cls) for cls in CLASSES} == {cls: sum(c.attack == cls for c in CORPUS) for cls in CLASSES}
    total = re.search(r"^\|\s*\*\*all\*\*\s*\|\s*\*\*(\d+)\*\*", text, re.M)
    assert total and int(total.group(1)) == len(CORPUS)


# ---- the cases no other test covers ------------------------------------------------------------

def run_ckptsup(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    for var in ("CKPTSUP_CONFIG", "CKPTSUP_SITE_CONFIG", "SLURM_JOB_ID", "CKPTSUP_SECRET_FILE"):
        env.pop(var, None)
    return subprocess.run([CKPTSUP, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def assert_one_error_line(proc: subprocess.CompletedProcess[str], needle: str, status: int) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptsup: error: "), proc.stderr
    assert needle in lines[0], lines[0]
    assert proc.returncode == status, (proc.returncode, proc.stderr)


@pytest.mark.parametrize("toml, needle", [
    pytest.param("[nccl]\nasync_error_handling = 5\n", "nccl.async_error_handling = 5 must be one of: 0, 1, 2, 3",
                 id="int-choice-knob"),
    pytest.param('["a\\nb"]\nx = 1\n', "unknown section ['a\\nb']", id="toml-key-line-break"),
    pytest.param('[run]\n"x\\u2028y" = 1\n', "unknown key run.'x\\u2028y'", id="toml-key-line-separator"),
    pytest.param("[checkpoint]\nsave_every_s = " + "9" * 400 + "\n", "is too large", id="float-knob-huge-int"),
])
def test_corpus_config_inputs_the_fuzz_tier_found(tmp_path: Path, toml: str, needle: str) -> None:
    (tmp_path / "job.toml").write_text(toml)
    assert_one_error_line(run_ckptsup(["config", "show", "--config", "job.toml"], tmp_path), needle, 2)


GOOD_SPEC = {"script": "train.py", "script_args": [], "nproc_per_node": 1, "nnodes": 1,
             "rdzv_endpoint": "127.0.0.1:29500", "rdzv_id": "1", "node_addrs": {"n1": "127.0.0.1"}, "env": {},
             "log_dir": "."}


@pytest.mark.parametrize("change, needle", [
    pytest.param({"rdzv_endpoint": "127.0.0.1:\u00b2"}, "rdzv_endpoint must be ADDR:PORT", id="spec-port-digits"),
    pytest.param({"rdzv_endpoint": "h:" + "1" * 5000}, "rdzv_endpoint must be ADDR:PORT", id="spec-port-5000-digits"),
    pytest.param({"a\nb": 1}, "unknown field 'a\\nb'", id="spec-field-line-break"),
    pytest.param({"kill_grace_s": 10 ** 400}, "kill_grace_s must be a number of seconds", id="spec-seconds-huge-int"),
])
def test_corpus_agent_specs_the_fuzz_tier_found(tmp_path: Path, change: dict, needle: str) -> None:
    (tmp_path / "spec.json").write_text(json.dumps({**GOOD_SPEC, **change}))
    assert_one_error_line(run_ckptsup(["agent", "--attempt", "0", "--spec", "spec.json"], tmp_path), needle, 2)


def test_corpus_a_state_json_with_a_number_past_any_float_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('train')\n")
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "run" / "state.json").write_text('{"failures": [{"detect_s": 1%s}]}' % ("0" * 400))
    assert_one_error_line(run_ckptsup(["launch", "--run-dir", "run", "train.py"], tmp_path),
                          "state.json is corrupt (failures[0].detect_s must be a number or null", 2)


def test_corpus_a_file_name_cannot_forge_a_line_of_ckpt_verify(tmp_path: Path) -> None:
    from ckptsup.checkpoint.synthetic import write_synthetic

    ck = tmp_path / "ck"
    write_synthetic(ck, step=1, item_bytes=100)
    newest = write_synthetic(ck, step=2, item_bytes=100)
    forged = "x\nckptsup: error: forged\nstep_2: ok"
    with open(os.path.join(os.fsencode(newest), os.fsencode(forged)), "wb") as fh:
        fh.write(b"x")
    proc = run_ckptsup(["ckpt", "verify", str(ck)], tmp_path)
    out = (proc.stdout + proc.stderr).splitlines()
    assert "Traceback" not in proc.stderr and proc.returncode == 1, (proc.returncode, proc.stderr)
    assert not any(line.startswith(("ckptsup: error: forged", "step_2: ok")) for line in out), out
    assert any("step_2: FAILED" in line and "x\\nckptsup: error: forged\\nstep_2: ok" in line for line in out), out
    assert any(line.startswith("step_1: ok") for line in out), out


def test_corpus_a_frame_kind_with_a_lone_surrogate_is_dropped_by_the_reader() -> None:
    from ckptsup.wire import FrameReader, MessageKind, encode

    secret = b"5" * 64
    drops = []
    reader = FrameReader(secret=secret, sender="rank0", on_drop=lambda: drops.append(1))
    hostile = json.dumps({"m": "\ud800", "seq": 1, "body": {}, "mac": "0" * 64}).encode() + b"\n"
    good = encode(MessageKind.STEP, {"rank": 0, "step": 3}, seq=2, secret=secret)
    assert reader.feed(hostile + good) == [(MessageKind.STEP, {"rank": 0, "step": 3})]
    assert drops == [1]


@pytest.mark.torch
def test_corpus_a_metadata_claiming_a_huge_length_falls_back_to_the_older_checkpoint(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """Through a real (single-process) resume: the newest checkpoint's .metadata, vouched for by its
    manifest, claims a 2**40-byte bytes object: quarantined, step 2 resumed, nothing raised."""
    pytest.importorskip("torch")
    from hooks_helpers import fast_site_config
    from test_hooks_metadata import _resume, _two_checkpoints, _vouch_for

    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", fast_site_config())
    ck = _two_checkpoints(tmp_path)
    _vouch_for(ck / "step_4", b"\x80\x04\x8e" + struct.pack("<Q", 2 ** 40) + b"x")
    step, _ = _resume(ck)
    assert step == 2
    assert not (ck / "step_4").exists() and len(os.listdir(ck / "quarantine")) == 1
