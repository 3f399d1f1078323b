"""Every bad input to the commands of checkpoint/, planning/ and slurm/ (and `config show`) is
refused with ONE stderr line `ckptsup: error: ...` that names the problem, a non-zero exit
status, and never a traceback. Each case runs the installed `ckptsup` as a subprocess, as a user
would. Unreadable paths are tried as the `nobody` user (root reads everything).

`nobody` often cannot reach the checkout or its venv at all: a clone in a 0700 directory (root's
home, `mktemp -d` in CI). So the as-nobody cases run a copy of the checkout's ckptsup package and
of its installed dependencies (the distributions its requirements need, not the extras) in a
world-traversable venv on the same base interpreter, started by a copy of the venv's own
`ckptsup` console script: the same code and the same entry point, reachable by nobody."""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest

CKPTSUP = str(Path(sys.executable).with_name("ckptsup"))
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if os.geteuid() == 0 else []


@pytest.fixture(scope="module")
def sandbox():
    """A world-traversable directory (nobody must reach it) holding one of each bad thing."""
    root = Path(tempfile.mkdtemp(prefix="ckptsup-bad-inputs-"))
    os.chmod(root, 0o755)
    (root / "afile").write_text("not a directory\n")
    (root / "empty").mkdir()
    (root / "train.py").write_text("print('train')\n")
    (root / "garbage.toml").write_text("this is = not [toml\n")
    (root / "unknown.toml").write_text("[nope]\nx = 1\n")
    (root / "negative.toml").write_text("[checkpoint]\nkeep_last = -3\n")
    (root / "nan.toml").write_text("[checkpoint]\nsave_every_s = nan\n")
    (root / "inf.toml").write_text("[checkpoint]\nsave_every_s = inf\n")
    (root / "overflow.toml").write_text("[checkpoint]\nsave_every_s = 1e400\n")
    (root / "hugeint.toml").write_text("[checkpoint]\nkeep_last = 99999999999999999999999999\n")
    (root / "wrongtype.toml").write_text('[checkpoint]\nkeep_last = "three"\n')
    (root / "hang_inf.toml").write_text("[supervisor]\nhang_timeout_s = inf\n")
    (root / "kill_grace_huge.toml").write_text("[supervisor]\nkill_grace_s = 1e300\n")
    (root / "port_huge.toml").write_text("[supervisor]\nrdzv_port = 99999999\n")
    (root / "bool_int.toml").write_text("[supervisor]\nnproc_per_node = true\n")
    (root / "lease_rule.toml").write_text("[supervisor]\nlease_interval_s = 2.0\nlease_stale_s = 3.0\n")
    (root / "silence_rule.toml").write_text("[supervisor]\nnode_silence_s = 0.5\n")
    os.mkfifo(root / "fifo.toml")
    (root / "link.toml").symlink_to(root / "inf.toml")
    (root / "big.toml").write_text("# " + "x" * (2 << 20) + "\n")
    (root / "spec_garbage.json").write_text("{not json")
    (root / "spec_list.json").write_text("[1, 2]")
    (root / "spec_missing_fields.json").write_text('{"script": "train.py"}')
    good_spec = {"script": "train.py", "script_args": [], "nproc_per_node": 1, "nnodes": 1,
                 "rdzv_endpoint": "127.0.0.1:29500", "rdzv_id": "1", "node_addrs": {"n1": "127.0.0.1"},
                 "env": {}, "log_dir": str(root)}
    (root / "spec_unknown_field.json").write_text(json.dumps({**good_spec, "bogus": 1}))
    (root / "spec_wrong_type.json").write_text(json.dumps({**good_spec, "nproc_per_node": "eight"}))
    (root / "spec_bool.json").write_text(json.dumps({**good_spec, "nnodes": True}))
    (root / "spec_nan.json").write_text(json.dumps({**good_spec, "kill_grace_s": float("nan")}))
    (root / "spec_env_not_str.json").write_text(json.dumps({**good_spec, "env": {"A": 1}}))
    (root / "spec_no_secret.json").write_text(json.dumps(good_spec))
    os.mkfifo(root / "spec_fifo.json")
    for name, state in (("run_state_list", "[]"), ("run_state_epoch_str", '{"epoch": "x"}'),
                        ("run_state_failures", '{"failures": [{"kind": "meteor"}]}')):
        (root / name).mkdir()
        (root / name / "state.json").write_text(state)
    (root / "garbage_ckpt" / "step_5").mkdir(parents=True)
    (root / "garbage_ckpt" / "step_5" / "manifest.json").write_text("{not json")
    (root / "deep_ckpt" / "step_1").mkdir(parents=True)
    (root / "deep_ckpt" / "step_1" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "bad_lock").mkdir()
    (root / "bad_lock" / ".writer.lock").write_text(json.dumps({"pid": "abc", "host": "x", "epoch": 1}))
    (root / "run_garbage").mkdir()
    (root / "run_garbage" / "events.jsonl").write_text("garbage{\n[1, 2]\n")
    (root / "run_empty_log").mkdir()
    (root / "run_empty_log" / "events.jsonl").write_text("")
    (root / "run_log_is_dir" / "events.jsonl").mkdir(parents=True)
    (root / "run_ok").mkdir()
    (root / "run_ok" / "events.jsonl").write_text(json.dumps(
        {"event": "supervisor_start", "ts": "2026-01-01T00:00:00Z", "mono": 1.0, "job_id": "1", "attempt": 0}) + "\n")
    for name, config_json in (("run_config_list", "[1]"), ("run_config_garbage", "{oops"),
                              ("run_config_bad_value", '{"config": {"checkpoint": {"keep_last": "x"}}}')):
        (root / name).mkdir()
        (root / name / "events.jsonl").write_text((root / "run_ok" / "events.jsonl").read_text())
        (root / name / "config.json").write_text(config_json)
    # unreadable for nobody: a root-owned 000 dir, and a nobody-owned checkpoint_dir whose step is 000
    (root / "unreadable").mkdir()
    os.chmod(root / "unreadable", 0o000)
    (root / "unreadable.toml").write_text("[checkpoint]\nkeep_last = 3\n")
    os.chmod(root / "unreadable.toml", 0o000)
    (root / "run_unreadable_log").mkdir()
    (root / "run_unreadable_log" / "events.jsonl").write_text((root / "run_ok" / "events.jsonl").read_text())
    os.chmod(root / "run_unreadable_log" / "events.jsonl", 0o000)
    part = root / "partly_unreadable"
    (part / "step_7").mkdir(parents=True)
    if os.geteuid() == 0:
        shutil.chown(part, "nobody", "nogroup")
        shutil.chown(part / "step_7", "nobody", "nogroup")
    os.chmod(part, 0o700)
    os.chmod(part / "step_7", 0o000)
    yield root
    for path in (root / "unreadable", part / "step_7"):
        os.chmod(path, 0o700)
    shutil.rmtree(root)


def _requirement_closure(name: str) -> list[metadata.Distribution]:
    """The installed distributions `name`'s requirements need (recursively), extras left out."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        req = todo.pop()
        key = re.sub(r"[-_.]+", "-", req).lower()
        if key in seen:
            continue
        seen[key] = dist = metadata.distribution(req)
        for line in dist.requires or ():
            dep, _, marker = line.partition(";")
            if "extra" in marker:
                continue
            dep_name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", dep).group(1)
            try:
                metadata.distribution(dep_name)
            except metadata.PackageNotFoundError:
                if marker.strip():
                    continue  # not needed on this interpreter (its marker is false here)
                raise
            todo.append(dep_name)
    return [dist for key, dist in seen.items() if key != re.sub(r"[-_.]+", "-", name).lower()]


def _world_readable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        os.chmod(path, mode | 0o444 | (0o111 if path.is_dir() or mode & 0o100 else 0))


@functools.cache
def nobody_ckptsup() -> str:
    """The `ckptsup` that user nobody runs (see the module docstring), built once per session in a
    world-traversable temp dir: a venv on this interpreter's base, holding a copy of the checkout's
    package (the one these tests import) and of its dependencies' installed files, plus a copy of
    this venv's `ckptsup` console script. Checked to run, and to run that copy."""
    import ckptsup

    root = Path(tempfile.mkdtemp(prefix="ckptsup-as-nobody-"))
    os.chmod(root, 0o755)
    home = root / "venv"
    venv.create(home, with_pip=False, symlinks=True)  # on sys._base_executable, no system site-packages
    (site,) = home.glob("lib/python*/site-packages")
    shutil.copytree(Path(ckptsup.__file__).parent, site / "ckptsup", ignore=shutil.ignore_patterns("__pycache__"))
    for dist in _requirement_closure("ckptsup"):
        for rel in dist.files or ():
            if rel.parts[0] == ".." or "__pycache__" in rel.parts:
                continue  # console scripts outside site-packages; caches are rebuilt
            src = Path(dist.locate_file(rel))
            if src.is_file():
                (site / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, site / rel)
    script = Path(CKPTSUP).read_text().splitlines(keepends=True)
    assert script[0].startswith("#!"), f"{CKPTSUP} is not a console script"
    shim = home / "bin" / "ckptsup"
    shim.write_text(f"#!{home / 'bin' / 'python'}\n" + "".join(script[1:]))
    shim.chmod(0o755)
    _world_readable(root)
    import atexit

    atexit.register(shutil.rmtree, root, ignore_errors=True)
    probe = subprocess.run([*AS_NOBODY, str(home / "bin" / "python"), "-c", "import ckptsup; print(ckptsup.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=root, env=nobody_env(dict(os.environ)))
    assert probe.returncode == 0, (f"user nobody cannot run the interpreter {sys._base_executable} "
                                   f"({probe.stderr.strip()[-200:]}); the as-nobody cases need a Python that "
                                   "nobody can reach (e.g. a system python3 for the venv)")
    assert probe.stdout.strip() == str(site / "ckptsup" / "__init__.py"), probe.stdout
    helped = subprocess.run([*AS_NOBODY, str(shim), "--help"], capture_output=True, text=True, timeout=60, cwd=root,
                            env=nobody_env(dict(os.environ)))
    assert helped.returncode == 0, helped.stderr
    return str(shim)


def nobody_env(env: dict[str, str]) -> dict[str, str]:
    """nobody runs the copy: a PYTHONPATH to the checkout would shadow it (or, unreachable, be skipped)."""
    env.pop("PYTHONPATH", None)
    return env


def run_ckptsup(args: list[str], cwd: Path, *, as_nobody: bool = False,
                env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SLURM_CONF=str(cwd / "no-such-slurm.conf"), COLUMNS="200")
    env.pop("CKPTSUP_CONFIG", None)
    env.pop("CKPTSUP_SITE_CONFIG", None)
    env.pop("SLURM_JOB_ID", None)
    env.update(env_extra or {})
    argv = [CKPTSUP, *args]
    if as_nobody and AS_NOBODY:
        argv = [*AS_NOBODY, nobody_ckptsup(), *args]
        env = nobody_env(env)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def assert_one_line_refusal(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckptsup: error: "), lines[0]
    assert needle.lower() in lines[0].lower(), lines[0]


STEADY = ["--stall", "30s", "--restart", "5m"]
PLAN = ["plan", "--gpus", "1024", *STEADY]
SIM = ["simulate", *STEADY, "--runs", "100"]

CASES = [
    # ---- ckpt list|verify|inspect|prune ----
    *[pytest.param(["ckpt", sub, "nope"], "nope does not exist", id=f"ckpt-{sub}-missing-path") for sub in
      ("list", "verify", "inspect", "prune")],
    *[pytest.param(["ckpt", sub, "afile"], "afile is not a directory", id=f"ckpt-{sub}-file-not-dir") for sub in
      ("list", "verify", "inspect", "prune")],
    *[pytest.param(["ckpt", sub], "missing argument 'dir'", id=f"ckpt-{sub}-no-dir") for sub in
      ("list", "verify", "inspect", "prune")],
    pytest.param(["ckpt", "verify", "empty"], "no step_<n> directories to verify", id="ckpt-verify-empty-dir"),
    pytest.param(["ckpt", "verify", "garbage_ckpt"], "failed verification", id="ckpt-verify-garbage-manifest"),
    pytest.param(["ckpt", "verify", "garbage_ckpt/step_5"], "failed verification", id="ckpt-verify-garbage-step"),
    pytest.param(["ckpt", "verify", "deep_ckpt"], "failed verification", id="ckpt-verify-deeply-nested-manifest"),
    pytest.param(["ckpt", "verify", "garbage_ckpt", "--level", "0"], "--level", id="ckpt-verify-level-zero"),
    pytest.param(["ckpt", "verify", "garbage_ckpt", "--level", "nan"], "--level", id="ckpt-verify-level-nan"),
    pytest.param(["ckpt", "verify", "garbage_ckpt", "--level", "99999999999999999999"], "--level",
                 id="ckpt-verify-level-huge"),
    pytest.param(["ckpt", "prune", "garbage_ckpt/step_5"], "prune takes the checkpoint_dir", id="ckpt-prune-one-step"),
    pytest.param(["ckpt", "prune", "empty", "--keep-last", "0"], "--keep-last", id="ckpt-prune-keep-zero"),
    pytest.param(["ckpt", "prune", "empty", "--keep-last", "-1"], "--keep-last", id="ckpt-prune-keep-negative"),
    pytest.param(["ckpt", "prune", "empty", "--keep-daily-days", "inf"], "--keep-daily-days",
                 id="ckpt-prune-daily-inf"),
    pytest.param(["ckpt", "prune", "bad_lock", "--keep-last", "1", "--keep-daily-days", "0"],
                 "not a lock ckptsup can read", id="ckpt-prune-garbage-writer-lock"),
    pytest.param(["ckpt", "bogus", "x"], "no such command 'bogus'", id="ckpt-unknown-subcommand"),
    # ---- plan ----
    pytest.param(["plan", *STEADY], "missing option '--gpus'", id="plan-no-gpus"),
    pytest.param([*PLAN[:2], "0", *STEADY, "--mtbf", "3h"], "fewer than one node", id="plan-zero-gpus"),
    pytest.param([*PLAN[:2], "-8", *STEADY, "--mtbf", "3h"], "fewer than one node", id="plan-negative-gpus"),
    pytest.param([*PLAN[:2], "99999999999999999999999", *STEADY, "--mtbf", "3h"], "at most",
                 id="plan-huge-gpus"),
    pytest.param([*PLAN[:2], "x", *STEADY], "'x' is not a valid integer", id="plan-gpus-not-a-number"),
    pytest.param(["plan", "--gpus", "1024", "--stall", "nan", "--restart", "5m", "--mtbf", "3h"],
                 "--stall 'nan' is not a number", id="plan-stall-nan"),
    pytest.param(["plan", "--gpus", "1024", "--stall", "inf", "--restart", "5m", "--mtbf", "3h"],
                 "--stall 'inf' is not a number", id="plan-stall-inf"),
    pytest.param(["plan", "--gpus", "1024", "--stall", "1e308y", "--restart", "5m", "--mtbf", "3h"],
                 "not a finite value", id="plan-stall-overflows-with-its-unit"),
    pytest.param(["plan", "--gpus", "1024", "--stall", "30parsec", "--restart", "5m", "--mtbf", "3h"],
                 "unknown unit 'parsec'", id="plan-unknown-duration-unit"),
    pytest.param([*PLAN, "--mtbf", "0s"], "greater than zero", id="plan-zero-mtbf"),
    pytest.param([*PLAN, "--mtbf", "-3h"], "negative", id="plan-negative-mtbf"),
    pytest.param([*PLAN, "--mtbf", "3h", "--price", "nan"], "--price must be a finite number", id="plan-price-nan"),
    pytest.param([*PLAN, "--mtbf", "3h", "--price", "inf"], "--price must be a finite number", id="plan-price-inf"),
    pytest.param([*PLAN, "--mtbf", "3h", "--price", "-1"], "--price must be a finite number",
                 id="plan-price-negative"),
    pytest.param([*PLAN, "--mtbf", "3h", "--keep-last", "0"], "--keep-last 0 must be >= 1", id="plan-keep-zero"),
    pytest.param([*PLAN, "--mtbf", "3h", "--gpus-per-node", "0"], "--gpus-per-node 0", id="plan-zero-per-node"),
    pytest.param([*PLAN, "--failures", "nan", "--over", "30d", "--on-gpus", "10"], "--failures nan",
                 id="plan-failures-nan"),
    pytest.param([*PLAN, "--failures", "-1", "--over", "30d", "--on-gpus", "10"], "--failures -1",
                 id="plan-failures-negative"),
    pytest.param([*PLAN, "--mtbf", "3h", "--spot-discount", "nan", "--preemptions-per-node-day", "1"],
                 "--spot-discount nan", id="plan-spot-discount-nan"),
    pytest.param([*PLAN, "--mtbf", "3h", "--spot-discount", "0.5", "--preemptions-per-node-day", "inf"],
                 "--preemptions-per-node-day inf", id="plan-preemptions-inf"),
    pytest.param([*PLAN, "--mtbf", "3h", "--ckpt-size", "3 parsecs"], "unknown unit", id="plan-unknown-size-unit"),
    pytest.param([*PLAN, "--mtbf", "3h", "--ckpt-size", "1e400GB"], "not finite", id="plan-size-overflow"),
    pytest.param([*PLAN, "--config", "nope.toml"], "nope.toml does not exist", id="plan-config-missing"),
    pytest.param([*PLAN, "--config", "empty"], "is a directory", id="plan-config-is-a-dir"),
    pytest.param([*PLAN, "--config", "garbage.toml"], "invalid toml", id="plan-config-garbage-toml"),
    # ---- simulate ----
    pytest.param([*SIM, "--gpus", "0"], "--gpus must be between 1", id="sim-zero-gpus"),
    pytest.param([*SIM, "--gpus", "999999999999"], "--gpus must be between 1", id="sim-huge-gpus"),
    pytest.param(["simulate", *STEADY, "--runs", "0"], "--runs must be between 1", id="sim-zero-runs"),
    pytest.param(["simulate", *STEADY, "--runs", "999999999999"], "--runs must be between 1", id="sim-huge-runs"),
    pytest.param([*SIM, "--days", "0"], "--days", id="sim-zero-days"),
    pytest.param([*SIM, "--days", "nan"], "--days", id="sim-nan-days"),
    pytest.param([*SIM, "--days", "inf"], "--days", id="sim-inf-days"),
    pytest.param([*SIM, "--days", "1e9"], "too many to simulate", id="sim-days-that-would-run-for-hours"),
    pytest.param([*SIM, "--mtbf", "1ms"], "too many to simulate", id="sim-tiny-mtbf"),
    pytest.param([*SIM, "--distribution", "weibull", "--weibull-shape", "0"], "--weibull-shape",
                 id="sim-weibull-zero"),
    pytest.param([*SIM, "--distribution", "weibull", "--weibull-shape", "nan"], "--weibull-shape",
                 id="sim-weibull-nan"),
    pytest.param([*SIM, "--distribution", "gamma"], "'gamma' is not one of", id="sim-unknown-distribution"),
    pytest.param([*SIM, "--spares", "-1"], "--spares", id="sim-negative-spares"),
    pytest.param(["simulate", *STEADY, "--spares", "4000", "--runs", "100000"], "too much memory",
                 id="sim-spares-times-runs-too-big"),
    pytest.param([*SIM, "--seed", "-1"], "--seed must be >= 0", id="sim-negative-seed"),
    pytest.param([*SIM, "--scale-to", "abc"], "--scale-to 'abc'", id="sim-scale-to-garbage"),
    pytest.param([*SIM, "--scale-to", "1,99999999999999"], "--scale-to", id="sim-scale-to-huge"),
    pytest.param([*SIM, "--interval", "0s"], "--interval '0s' must be greater than zero", id="sim-zero-interval"),
    # ---- report ----
    pytest.param(["report", "nope"], "'nope' does not exist", id="report-missing-dir"),
    pytest.param(["report", "afile"], "is a file", id="report-file-not-dir"),
    pytest.param(["report", "empty"], "events.jsonl' not found", id="report-dir-without-log"),
    pytest.param(["report", "run_garbage"], "holds no ckptsup events", id="report-garbage-log"),
    pytest.param(["report", "run_empty_log"], "holds no ckptsup events", id="report-empty-log"),
    pytest.param(["report", "run_log_is_dir"], "cannot read", id="report-log-is-a-directory"),
    pytest.param(["report", "run_ok", "--price", "nan"], "--price must be a finite number", id="report-price-nan"),
    pytest.param(["report", "run_ok", "--price", "-1"], "--price must be a finite number", id="report-price-negative"),
    pytest.param(["report", "run_ok", "--png", "/nonexistent/x.png"], "cannot write", id="report-png-unwritable"),
    pytest.param(["report", "run_ok", "--html", "empty"], "is a directory", id="report-html-is-a-dir"),
    pytest.param(["report", "run_ok", "--config", "garbage.toml"], "invalid toml", id="report-config-garbage"),
    pytest.param(["report", "run_config_list"], "is not a ckptsup config", id="report-run-config-not-an-object"),
    pytest.param(["report", "run_config_garbage"], "unreadable", id="report-run-config-not-json"),
    pytest.param(["report", "run_config_bad_value"], "keep_last = 'x' must be an integer",
                 id="report-run-config-bad-value"),
    # ---- sbatch ----
    pytest.param(["sbatch"], "missing argument 'script'", id="sbatch-no-script"),
    pytest.param(["sbatch", "nope.py"], "nope.py does not exist", id="sbatch-missing-script"),
    pytest.param(["sbatch", "empty"], "is a directory", id="sbatch-script-is-a-dir"),
    pytest.param(["sbatch", "--nodes", "0", "train.py"], "sbatch.nodes = 0", id="sbatch-zero-nodes"),
    pytest.param(["sbatch", "--nodes", "-1", "train.py"], "sbatch.nodes = -1", id="sbatch-negative-nodes"),
    pytest.param(["sbatch", "--nodes", "99999999999", "train.py"], "more than any cluster", id="sbatch-huge-nodes"),
    pytest.param(["sbatch", "--nodes", "nan", "train.py"], "'nan' is not a valid integer", id="sbatch-nan-nodes"),
    pytest.param(["sbatch", "--spares", "-1", "train.py"], "sbatch.spares = -1", id="sbatch-negative-spares"),
    pytest.param(["sbatch", "--nproc-per-node", "-3", "train.py"], "nproc_per_node = -3",
                 id="sbatch-negative-nproc"),
    pytest.param(["sbatch", "--gpus-per-node", "99999", "train.py"], "gpus_per_node = 99999",
                 id="sbatch-huge-gpus-per-node"),
    pytest.param(["sbatch", "--signal-lead-s", "-5", "train.py"], "signal_lead_s", id="sbatch-negative-signal-lead"),
    pytest.param(["sbatch", "--signal-lead-s", "99999999999", "train.py"], "between 1 and 65535",
                 id="sbatch-huge-signal-lead"),
    pytest.param(["sbatch", "--time", "nan", "train.py"], "not a slurm time", id="sbatch-time-nan"),
    pytest.param(["sbatch", "--time", "-1", "train.py"], "not a slurm time", id="sbatch-time-negative"),
    pytest.param(["sbatch", "--time", "inf", "train.py"], "not a slurm time", id="sbatch-time-inf"),
    pytest.param(["sbatch", "--template", "nope", "train.py"], "template 'nope' not found", id="sbatch-no-template"),
    pytest.param(["sbatch", "--partition", "a b", "train.py"], "may hold only", id="sbatch-partition-with-space"),
    pytest.param(["sbatch", "--account", "$(id)", "train.py"], "may hold only", id="sbatch-account-injection"),
    pytest.param(["sbatch", "--job-name", "a\nb", "train.py"], "may hold only", id="sbatch-job-name-newline"),
    pytest.param(["sbatch", "--extra-directive", "--qos=x\nrm -rf /", "train.py"], "must be one option",
                 id="sbatch-extra-directive-newline"),
    pytest.param(["sbatch", "--run-dir", "/tmp/x\ny", "train.py"], "run_dir", id="sbatch-run-dir-newline"),
    pytest.param(["sbatch", "--output", "/nonexistent/job.sh", "train.py"], "cannot write the job script",
                 id="sbatch-output-unwritable"),
    pytest.param(["sbatch", "--output", "empty", "train.py"], "is a directory", id="sbatch-output-is-a-dir"),
    pytest.param(["sbatch", "--config", "garbage.toml", "train.py"], "invalid toml", id="sbatch-config-garbage"),
    pytest.param(["sbatch", "--config", "unknown.toml", "train.py"], "unknown section [nope]",
                 id="sbatch-config-unknown-section"),
    pytest.param(["sbatch", "--submit", "train.py"], "slurm_conf", id="sbatch-submit-without-a-cluster"),
    # ---- dev-cluster ----
    pytest.param(["dev-cluster", "status", "--dir", "nope"], "no dev cluster in nope", id="devcluster-status-missing-dir"),
    pytest.param(["dev-cluster", "status", "--dir", "afile"], "is a file", id="devcluster-status-dir-is-a-file"),
    pytest.param(["dev-cluster", "status", "--dir", "/tmp/a b"], "may hold only letters", id="devcluster-dir-with-space"),
    pytest.param(["dev-cluster", "up", "--dir", "/tmp/x;touch /tmp/pwned"], "may hold only letters",
                 id="devcluster-dir-with-shell-characters"),
    pytest.param(["dev-cluster", "status", "--port-base", "0"], "--port-base", id="devcluster-port-zero"),
    pytest.param(["dev-cluster", "status", "--port-base", "99999999"], "--port-base", id="devcluster-port-huge"),
    pytest.param(["dev-cluster", "status", "--port-base", "nan"], "--port-base", id="devcluster-port-nan"),
    pytest.param(["dev-cluster", "kill-node"], "missing argument 'node'", id="devcluster-kill-no-node"),
    pytest.param(["dev-cluster", "kill-node", "nX", "--dir", "empty"], "unknown node 'nx'", id="devcluster-kill-unknown"),
    pytest.param(["dev-cluster", "kill-node", "n1;id", "--dir", "empty"], "unknown node", id="devcluster-kill-injection"),
    pytest.param(["dev-cluster", "kill-node", "n1", "--dir", "empty"], "is not running", id="devcluster-kill-not-running"),
    pytest.param(["dev-cluster", "revive-node", "n1", "--dir", "empty"], "is not up", id="devcluster-revive-not-up"),
    pytest.param(["dev-cluster", "up", "--dir", "/proc/ckptsup-nope", "--port-base", "23400"], "/proc/ckptsup-nope",
                 id="devcluster-up-unwritable-dir"),
    pytest.param(["dev-cluster", "bogus"], "no such command 'bogus'", id="devcluster-unknown-subcommand"),
    # ---- config show ----
    pytest.param(["config", "show", "--config", "nope.toml"], "nope.toml does not exist", id="config-missing"),
    pytest.param(["config", "show", "--config", "empty"], "is a directory", id="config-is-a-dir"),
    pytest.param(["config", "show", "--config", "garbage.toml"], "invalid toml", id="config-garbage-toml"),
    pytest.param(["config", "show", "--config", "unknown.toml"], "unknown section [nope]", id="config-unknown-section"),
    pytest.param(["config", "show", "--config", "negative.toml"], "keep_last = -3", id="config-negative"),
    pytest.param(["config", "show", "--config", "nan.toml"], "must be a finite number", id="config-nan"),
    pytest.param(["config", "show", "--config", "inf.toml"], "must be a finite number", id="config-inf"),
    pytest.param(["config", "show", "--config", "overflow.toml"], "must be a finite number", id="config-overflow"),
    pytest.param(["config", "show", "--config", "hugeint.toml"], "too large", id="config-huge-int"),
    pytest.param(["config", "show", "--config", "wrongtype.toml"], "must be an integer", id="config-wrong-type"),
    pytest.param(["config", "show", "--config", "hang_inf.toml"], "hang_timeout_s = inf must be a finite number",
                 id="config-hang-timeout-inf"),
    pytest.param(["config", "show", "--config", "kill_grace_huge.toml"], "kill_grace_s = 1e+300 must be at most 3600",
                 id="config-kill-grace-huge"),
    pytest.param(["config", "show", "--config", "port_huge.toml"], "rdzv_port = 99999999 must be between 1 and 63536",
                 id="config-rdzv-port-huge"),
    pytest.param(["config", "show", "--config", "bool_int.toml"], "nproc_per_node = True must be an integer",
                 id="config-bool-for-int"),
    pytest.param(["config", "show", "--config", "lease_rule.toml"],
                 "lease_stale_s = 3.0 (job:lease_rule.toml) must be at least 2 x supervisor.lease_interval_s = 2.0",
                 id="config-lease-stale-below-twice-the-interval"),
    pytest.param(["config", "show", "--config", "silence_rule.toml"],
                 "node_silence_s = 0.5 (job:silence_rule.toml) must be at least 2 x supervisor.heartbeat_interval_s",
                 id="config-node-silence-below-two-heartbeats"),
    pytest.param(["config", "show", "--config", "fifo.toml"], "fifo.toml is a FIFO, not a regular file",
                 id="config-is-a-fifo"),
    pytest.param(["config", "show", "--config", "/dev/zero"], "/dev/zero is a character device", id="config-dev-zero"),
    pytest.param(["config", "show", "--config", "big.toml"], "at most 1048576 are read", id="config-too-big"),
    pytest.param(["config", "show", "--config", "link.toml"], "must be a finite number", id="config-symlink-is-followed"),
    pytest.param([*PLAN, "--config", "fifo.toml"], "is a FIFO", id="plan-config-is-a-fifo"),
    pytest.param(["sbatch", "--config", "fifo.toml", "train.py"], "is a FIFO", id="sbatch-config-is-a-fifo"),
    # ---- launch: the config is refused before anything starts ----
    pytest.param(["launch", "--config", "hang_inf.toml", "train.py"], "hang_timeout_s = inf must be a finite number",
                 id="launch-hang-timeout-inf"),
    pytest.param(["launch", "--config", "kill_grace_huge.toml", "train.py"], "kill_grace_s = 1e+300",
                 id="launch-kill-grace-huge"),
    pytest.param(["launch", "--config", "fifo.toml", "train.py"], "is a FIFO", id="launch-config-is-a-fifo"),
    pytest.param(["launch", "--config", "/dev/zero", "train.py"], "is a character device", id="launch-config-dev-zero"),
    pytest.param(["launch", "--memory-every-steps", "0", "train.py"], "memory.every_steps = 0 must be >= 1",
                 id="launch-memory-every-steps-zero"),
    # ---- launch: the run dir's state.json, wrong shape or types ----
    pytest.param(["launch", "--run-dir", "run_state_list", "train.py"], "state.json is corrupt (not a JSON object",
                 id="launch-state-json-a-list"),
    pytest.param(["launch", "--run-dir", "run_state_epoch_str", "train.py"], "state.json is corrupt (epoch must be",
                 id="launch-state-json-epoch-a-string"),
    pytest.param(["launch", "--run-dir", "run_state_failures", "train.py"], "state.json is corrupt (failures[0].kind",
                 id="launch-state-json-unknown-failure-kind"),
]


@pytest.mark.parametrize(("args", "needle"), CASES)
def test_bad_input_is_one_error_line_naming_the_problem(sandbox: Path, args: list[str], needle: str) -> None:
    assert_one_line_refusal(run_ckptsup(args, sandbox), needle)


SITE_CASES = [
    pytest.param("empty", "site config ($CKPTSUP_SITE_CONFIG) {p} is a directory", id="site-config-is-a-dir"),
    pytest.param("/dev/zero", "site config ($CKPTSUP_SITE_CONFIG) /dev/zero is a character device",
                 id="site-config-dev-zero"),
    pytest.param("fifo.toml", "site config ($CKPTSUP_SITE_CONFIG) {p} is a FIFO", id="site-config-fifo"),
    pytest.param("big.toml", "at most 1048576 are read", id="site-config-too-big"),
    pytest.param("nope.toml", "site config ($CKPTSUP_SITE_CONFIG) {p} does not exist", id="site-config-missing"),
    pytest.param("lease_rule.toml", "must be at least 2 x supervisor.lease_interval_s", id="site-config-lease-rule"),
]


@pytest.mark.parametrize(("site", "needle"), SITE_CASES)
@pytest.mark.parametrize("command", [["config", "show"], ["launch", "train.py"], [*PLAN, "--mtbf", "3h"]],
                         ids=["config-show", "launch", "plan"])
def test_a_bad_site_config_is_one_error_line(sandbox: Path, site: str, needle: str, command: list[str]) -> None:
    path = site if site.startswith("/") else str(sandbox / site)
    proc = run_ckptsup(command, sandbox, env_extra={"CKPTSUP_SITE_CONFIG": path})
    assert_one_line_refusal(proc, needle.format(p=path))
    assert proc.returncode == 2


AGENT = ["agent", "--attempt", "0", "--spec"]
AGENT_CASES = [
    pytest.param("spec_garbage.json", "launch spec", "is not valid JSON", id="agent-spec-not-json"),
    pytest.param("spec_list.json", "launch spec", "not a JSON object", id="agent-spec-a-list"),
    pytest.param("spec_missing_fields.json", "launch spec", "lacks script_args", id="agent-spec-missing-fields"),
    pytest.param("spec_unknown_field.json", "launch spec", "unknown field bogus", id="agent-spec-unknown-field"),
    pytest.param("spec_wrong_type.json", "launch spec", "nproc_per_node must be", id="agent-spec-wrong-type"),
    pytest.param("spec_bool.json", "launch spec", "nnodes must be", id="agent-spec-bool-for-int"),
    pytest.param("spec_nan.json", "launch spec", "not valid JSON", id="agent-spec-nan"),
    pytest.param("spec_env_not_str.json", "launch spec", "env must be", id="agent-spec-env-not-strings"),
    pytest.param("spec_fifo.json", "launch spec", "is a FIFO", id="agent-spec-fifo"),
    pytest.param("nope.json", "launch spec", "does not exist", id="agent-spec-missing"),
    pytest.param("spec_no_secret.json", "CKPTSUP_SECRET_FILE", "CKPTSUP_SECRET_FILE", id="agent-spec-without-secret"),
]


@pytest.mark.parametrize(("spec", "what", "needle"), AGENT_CASES)
def test_a_bad_agent_spec_is_one_error_line_and_exit_2(sandbox: Path, spec: str, what: str, needle: str) -> None:
    """The hidden `ckptsup agent --spec FILE`: the supervisor writes the spec, but a damaged or
    foreign one is the agent's input like any other, and ends it as a usage error (2)."""
    proc = run_ckptsup([*AGENT, spec], sandbox)
    assert_one_line_refusal(proc, needle)
    assert what in proc.stderr and proc.returncode == 2


NOBODY_CASES = [
    *[pytest.param(["ckpt", sub, "unreadable"], "not readable by you", id=f"ckpt-{sub}-unreadable-dir")
      for sub in ("list", "verify", "inspect", "prune")],
    pytest.param(["ckpt", "verify", "partly_unreadable"], "failed verification", id="ckpt-verify-unreadable-step"),
    pytest.param(["report", "unreadable"], "not readable", id="report-unreadable-dir"),
    pytest.param(["report", "run_unreadable_log"], "cannot read", id="report-unreadable-log"),
    pytest.param(["config", "show", "--config", "unreadable.toml"], "not readable", id="config-unreadable-file"),
    pytest.param(["plan", "--gpus", "1024", *STEADY, "--config", "unreadable.toml"], "not readable",
                 id="plan-config-unreadable"),
    pytest.param(["dev-cluster", "up", "--dir", "unreadable/x", "--port-base", "23400"], "root",
                 id="devcluster-up-not-root"),
]


@pytest.mark.parametrize(("args", "needle"), NOBODY_CASES)
def test_unreadable_input_is_one_error_line(sandbox: Path, args: list[str], needle: str) -> None:
    assert_one_line_refusal(run_ckptsup(args, sandbox, as_nobody=True), needle)


def test_verify_names_the_unreadable_step_and_the_fix(sandbox: Path) -> None:
    proc = run_ckptsup(["ckpt", "verify", "partly_unreadable"], sandbox, as_nobody=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "step_7: FAILED" in proc.stdout and "chmod u+rx" in proc.stdout


def test_list_of_an_empty_checkpoint_dir_is_not_an_error(sandbox: Path) -> None:
    """A fresh checkpoint_dir has no checkpoints yet: listing it is an answer, not a refusal."""
    proc = run_ckptsup(["ckpt", "list", "empty"], sandbox)
    assert proc.returncode == 0 and proc.stderr == ""
    assert "no checkpoints" in proc.stdout


@pytest.mark.parametrize("group", ["ckpt", "dev-cluster"])
def test_a_bare_command_group_prints_its_help_not_an_error(sandbox: Path, group: str) -> None:
    proc = run_ckptsup([group], sandbox)
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and "ckptsup: error" not in output
    assert f"Usage: ckptsup {group}" in output and "Commands:" in output


def test_a_misspelt_subcommand_is_one_line_with_the_suggestion(sandbox: Path) -> None:
    assert_one_line_refusal(run_ckptsup(["ckpt", "lst", "x"], sandbox), "did you mean 'list'")
