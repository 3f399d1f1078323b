"""Capture the literal `squeue --json` answers the parsers are tested on, from the Slurm on PATH
(run against a dev cluster: SLURM_CONF set). Writes tests/golden/slurm/<major.minor>/*.json:

  finished_exit3.json      a job that ended with exit 3 (`--states=all`)
  finished_default.json    the same job without --states=all (23.02+: "jobs": [])
  requeued_completing.json a job right after `scontrol requeue`, still completing
  unreachable.json         squeue against a controller that is not there (exit status kept)
  ids.json                 which job of those answers is which (22.05 lists every job)

    SLURM_CONF=... python tests/golden/slurm/capture.py
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def run(*argv, env=None):
    return subprocess.run(argv, capture_output=True, text=True, env=env or os.environ, check=False)


def squeue(job, *extra, env=None):
    return run("squeue", "--json", *extra, "--jobs", job, env=env)


def state_of(text, job):
    # 22.05 ignores --jobs under --json (every job comes back): pick ours
    jobs = [j for j in json.loads(text).get("jobs", []) if str(j.get("job_id")) == job]
    return jobs[0]["job_state"] if jobs else None


def main():
    version = re.search(r"(\d+)\.(\d+)", run("slurmd", "-V").stdout).group(0)
    out = Path(__file__).parent / version
    out.mkdir(exist_ok=True)
    job = run("sbatch", "--parsable", "-N1", "-o", "/dev/null", "--wrap", "exit 3").stdout.strip()
    for _ in range(100):
        done = squeue(job, "--states=all")
        if state_of(done.stdout, job) in ("FAILED", ["FAILED"]):
            break
        time.sleep(0.1)
    (out / "finished_exit3.json").write_text(done.stdout)
    ids = {"finished": job}
    (out / "finished_default.json").write_text(squeue(job).stdout)

    job = run("sbatch", "--parsable", "-N1", "--requeue", "-o", "/dev/null", "--wrap",
              "trap '' TERM; sleep 60").stdout.strip()   # ignores TERM: completing lasts KillWait
    for _ in range(100):
        if state_of(squeue(job).stdout, job) in ("RUNNING", ["RUNNING"]):
            break
        time.sleep(0.1)
    run("scontrol", "requeue", job)
    seen = []
    for _ in range(300):
        answer = squeue(job, "--states=all")
        state = state_of(answer.stdout, job)
        if state not in seen:
            seen.append(state)
            if "COMPLETING" in json.dumps(state):
                (out / "requeued_completing.json").write_text(answer.stdout)
        if state in ("PENDING", ["PENDING"]):
            break
        time.sleep(0.05)
    run("scancel", job)
    ids["requeued"] = job
    (out / "ids.json").write_text(json.dumps(ids) + "\n")
    print(f"{version}: states after requeue: {seen}")

    conf = Path(os.environ["SLURM_CONF"]).read_text()
    bad = Path(out / "unreachable.conf")
    bad.write_text(re.sub(r"(?m)^SlurmctldPort=.*$", "SlurmctldPort=1", conf))
    answer = squeue("1", "--states=all", env={**os.environ, "SLURM_CONF": str(bad)})
    bad.unlink()
    (out / "unreachable.json").write_text(json.dumps({"returncode": answer.returncode, "stdout": answer.stdout,
                                                      "stderr": answer.stderr}, indent=1))
    print(f"{version}: unreachable rc={answer.returncode} stderr={answer.stderr.strip()[:200]!r}")


if __name__ == "__main__":
    sys.exit(main())
