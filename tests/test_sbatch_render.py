"""sbatch rendering: golden files, refusals, and the rendered script's own logic (signal
forwarding, requeue decision) run in bash with a stand-in for the three Slurm commands it calls.
The same script also runs on the real cluster in test_sbatch_submit.py.

Regenerate the golden files after an intended template change with
CKPTSUP_UPDATE_GOLDEN=1 pytest tests/test_sbatch_render.py and review the diff."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ckptsup.config import load_config
from ckptsup.env import ExitStatus, should_requeue
from ckptsup.errors import ConfigError
from ckptsup.resources import sbatch_templates_dir
from ckptsup.slurm.render import SbatchParams, params_from_config, render_sbatch
from ckptsup.slurm.submit import prepare

GOLDEN = Path(__file__).parent / "golden"
TEMPLATE = (sbatch_templates_dir() / "train.sbatch").read_text()


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("CKPTSUP_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"rendered script differs from {path}; see the module docstring"


def test_default_render_matches_golden_file(tmp_path):
    config = load_config(env={"CKPTSUP_SITE_CONFIG": str(Path(__file__).parents[1] / "site_config" / "default.toml")}).config
    params = params_from_config(config.sbatch, run_dir="/shared/runs/{job_id}", script="/home/u/train.py",
                                script_args=("--steps", "100"))
    check_golden("train_default.sbatch", render_sbatch(TEMPLATE, params))


def test_site_render_with_partition_gpus_spares_and_extra_directives_matches_golden_file():
    params = SbatchParams(run_dir="/lustre/proj/runs/llm-7b", script="/home/u/train.py", script_args=("--lr", "3e-4"),
                          nodes=8, spares=2, job_name="llm-7b", time="2-00:00:00", partition="gpu-spanning",
                          account="proj42", gpus_per_node=8, cpus_per_task=64, signal_lead_s=300,
                          extra_directives=("--qos=high", "--exclusive"), job_config="/home/u/job.toml",
                          nproc_per_node=8, ckptsup="/opt/ckptsup/bin/ckptsup")
    check_golden("train_site.sbatch", render_sbatch(TEMPLATE, params))


def test_rendered_script_has_the_recovery_directives():
    text = render_sbatch(TEMPLATE, SbatchParams(run_dir="/r/{job_id}", script="/t.py", nodes=3, spares=1,
                                                signal_lead_s=90))
    for line in ("#SBATCH --requeue", "#SBATCH --no-kill", "#SBATCH --signal=B:USR1@90",
                 "#SBATCH --open-mode=append", "#SBATCH --nodes=4", "#SBATCH --output=/r/%j/slurm-%j.out"):
        assert line in text.splitlines()
    assert "exec " not in text  # the supervisor must be a child the script outlives
    assert 'RUN_DIR=/r/"${SLURM_JOB_ID}"' in text
    assert "launch --run-dir \"$RUN_DIR\" --nodes 3 --spares 1 --gpus-per-node 0 --signal-lead-s 90 /t.py" in text


def test_a_module_or_an_executable_reaches_the_launch_line_and_bad_ones_are_one_line(tmp_path):
    text = prepare(flags={}, job_config=None, script="pkg.train", script_args=("--lr", "3"), module=True,
                   cwd=tmp_path).text
    assert "-m pkg.train --lr 3" in text
    exe = tmp_path / "rank.sh"
    exe.write_text("#!/bin/sh\n")
    with pytest.raises(ConfigError, match="is not executable"):
        prepare(flags={}, job_config=None, script=str(exe), no_python=True, cwd=tmp_path)
    exe.chmod(0o755)
    assert f"--no-python {exe}" in prepare(flags={}, job_config=None, script=str(exe), no_python=True, cwd=tmp_path).text
    for bad, why in (("train.py", "not a module name"), ("a b", "not a module name")):
        with pytest.raises(ConfigError, match=why):
            prepare(flags={}, job_config=None, script=bad, module=True, cwd=tmp_path)


def test_arguments_with_shell_characters_are_quoted():
    text = render_sbatch(TEMPLATE, SbatchParams(run_dir="/r", script="/t.py", script_args=("$(rm -rf /)", "a b")))
    assert "'$(rm -rf /)' 'a b'" in text


@pytest.mark.parametrize("kw,message", [
    (dict(nodes=0), "sbatch.nodes = 0 must be >= 1"),
    (dict(spares=-1), "sbatch.spares = -1 must be >= 0"),
    (dict(time="soon"), "is not a Slurm time"),
    (dict(partition="main\n#SBATCH --uid=0"), "may hold only letters"),
    (dict(run_dir="relative/dir"), "must be absolute"),
    (dict(run_dir="/has space"), "no spaces"),
    (dict(extra_directives=("--qos=high\n#SBATCH --x",)), "must be one option"),
    (dict(signal_lead_s=0), "between 1 and 65535"),
    (dict(nodes=99_999, spares=2), "more than any cluster"),
    (dict(nproc_per_node=-3), "nproc_per_node = -3"),
    (dict(gpus_per_node=99_999), "gpus_per_node = 99999"),
    (dict(cpus_per_task=-1), "cpus_per_task = -1"),
])
def test_bad_values_are_refused_with_one_line(kw, message):
    base = dict(run_dir="/r", script="/t.py")
    base.update(kw)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        render_sbatch(TEMPLATE, SbatchParams(**base))
    assert "\n" not in str(err.value)


def test_template_placeholder_unknown_to_ckptsup_is_refused():
    with pytest.raises(ConfigError, match=r"uses \{\{gpu_type\}\}"):
        render_sbatch(TEMPLATE + "{{gpu_type}}\n", SbatchParams(run_dir="/r", script="/t.py"))


def test_flags_override_site_defaults_and_relative_paths_are_resolved(tmp_path, monkeypatch):
    site = tmp_path / "site.toml"
    site.write_text('[sbatch]\npartition = "main"\nnodes = 4\ntime = "01:00:00"\n')
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site))
    (tmp_path / "train.py").write_text("pass\n")
    prepared = prepare(flags={"sbatch.nodes": 2, "sbatch.spares": 1}, job_config=None, script="train.py",
                       cwd=tmp_path, ckptsup="ckptsup")
    assert prepared.params.nodes == 2 and prepared.params.spares == 1
    assert prepared.params.partition == "main" and prepared.params.time == "01:00:00"
    assert prepared.params.run_dir == f"{tmp_path}/ckptsup-runs/{{job_id}}"
    assert f"--nodes 2 --spares 1 --gpus-per-node 0 --signal-lead-s 120 {tmp_path}/train.py" in prepared.text


def launched_config(argv, monkeypatch):
    """The Resolved config `ckptsup launch argv` hands the supervisor (which is not started)."""
    from ckptsup import cli
    from hooks_helpers import capture_supervisor

    seen = capture_supervisor(monkeypatch)
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 0
    return seen["resolved"], seen["job"]


def test_every_submitted_sbatch_value_the_supervisor_uses_reaches_it_inside_the_job(tmp_path, monkeypatch):
    import shlex

    site = tmp_path / "site.toml"
    site.write_text("[sbatch]\nspares = 5\nsignal_lead_s = 300\n")
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", str(site))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    prepared = prepare(flags={"sbatch.nodes": 1, "sbatch.spares": 2, "sbatch.gpus_per_node": 4,
                              "sbatch.signal_lead_s": 77}, job_config=None, script="train.py", cwd=tmp_path,
                       ckptsup="ckptsup")
    [line] = [x for x in prepared.text.splitlines() if x.startswith("ckptsup launch ")]
    argv = shlex.split(line.removesuffix(" &").replace('"$RUN_DIR"', str(tmp_path / "run")))
    # by the time the job starts (or is requeued) the site file says something else
    site.write_text("[sbatch]\nspares = 9\nsignal_lead_s = 30\ngpus_per_node = 1\n")
    resolved, job = launched_config(argv[1:], monkeypatch)
    sbatch = resolved.config.sbatch
    assert (sbatch.spares, sbatch.gpus_per_node, sbatch.signal_lead_s) == (2, 4, 77)
    assert resolved.config.supervisor.nodes == 1 and job.nodes_needed == 1
    assert job.script == str(tmp_path / "train.py")


# ---- the script's own logic, in bash ----------------------------------------------------------

STUBS = {
    # the three Slurm commands the script calls, as stand-ins that record their arguments
    "scontrol": 'if [ "$1 $2" = "show hostnames" ]; then echo n1; echo n2; else echo "scontrol $*" >> "$LOG"; fi',
    "srun": 'echo "srun $*" >> "$LOG"; exec sleep 30',
    "ckreq": 'echo "requeue $*" >> "$LOG"',  # stands in for `ckptsup requeue --run-dir DIR`
}


def run_script(tmp_path: Path, launch: str, *, requeue_command: str | None = None, send: int | None = None):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bindir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bindir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    params = SbatchParams(run_dir=str(tmp_path / "run"), script="/t.py", launch_command=launch,
                          requeue_command=requeue_command or "ckreq",
                          watchdog_command="sleep 30 watchdog x y")
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(TEMPLATE, params))
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", LOG=str(log), SLURM_JOB_ID="77",
               SLURM_JOB_NODELIST="n[1-2]", SLURMD_NODENAME="n1")
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if send is not None:
        time.sleep(0.5)
        proc.send_signal(send)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out, log.read_text()


@pytest.mark.parametrize("rc", [0, 1, 2, 3, 4, 5, 6, 7, 9, 42])
def test_script_requeues_exactly_when_should_requeue_says_so(tmp_path, rc):
    code, out, calls = run_script(tmp_path, f"bash -c 'exit {rc}'")
    assert code == rc
    assert ("requeue --reason" in calls) == should_requeue(rc), (out, calls)


def test_supervisor_killed_by_a_signal_is_requeued_as_supervisor_died(tmp_path):
    code, out, calls = run_script(tmp_path, "bash -c 'kill -9 $$'")
    assert code == 137
    assert "requeue --reason supervisor_died" in calls


def test_preempted_and_requeue_statuses_requeue_with_their_reasons(tmp_path):
    assert "requeue --reason preempted" in run_script(tmp_path, f"bash -c 'exit {int(ExitStatus.PREEMPTED)}'")[2]
    assert "requeue --reason requeue_requested" in run_script(tmp_path, f"bash -c 'exit {int(ExitStatus.REQUEUE)}'")[2]


def test_watchdog_step_runs_on_another_node_with_overlap(tmp_path):
    _, _, calls = run_script(tmp_path, "sleep 0.5")
    assert "srun --overlap -N1 -n1 -w n2 sleep 30 watchdog x y" in calls


def test_failed_ckptsup_requeue_falls_back_to_scontrol_requeue(tmp_path):
    _, out, calls = run_script(tmp_path, "bash -c 'exit 1'", requeue_command="false")
    assert "scontrol requeue 77" in calls and "falling back" in out


@pytest.mark.parametrize("sig,name", [(signal.SIGUSR1, "USR1"), (signal.SIGTERM, "TERM")])
def test_usr1_and_term_are_forwarded_to_the_supervisor_and_its_status_is_kept(tmp_path, sig, name):
    # the stand-in supervisor exits PREEMPTED when it receives the signal
    launch = (f"bash -c 'trap \"echo got-{name}; exit {int(ExitStatus.PREEMPTED)}\" {name}; "
              "for i in $(seq 100); do sleep 0.1; done; exit 0'")
    code, out, calls = run_script(tmp_path, launch, send=sig)
    assert f"got-{name}" in out and f"SIG{name} received; forwarding" in out
    assert code == int(ExitStatus.PREEMPTED)
    assert "requeue --reason preempted" in calls
