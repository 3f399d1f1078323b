"""SlurmClient: the one seam through which ckptsup runs Slurm commands.

Every subprocess call to srun, sbatch, scontrol, squeue, sinfo, sacct and scancel goes through
`SlurmClient.run`. Transient failures (controller busy or unreachable, socket timed out, a command
that times out) are retried with tenacity inside a bounded time; a permanent failure raises
`SlurmCommandError(cmd, rc, stderr)`. Commands honour SLURM_CONF from the environment given to
the client (default: os.environ), which is how the dev cluster is reached.

Long-lived steps (the agents' srun, the watchdog) are never run here: `srun_argv` only builds
their argv, and the supervisor Popens it.

Unit tests replace the runner (`runner=`) with a fake; every behaviour also has a test on the
real dev cluster (tests/test_slurm_cluster.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import hostlist
import tenacity

from ..env import SLURM_CONF
from ..errors import SlurmCommandError
from . import parsers
from .allocation import Allocation, allocation_from_env, gpus_from_scontrol
from .parsers import JobInfo, NodeInfo


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[list[str], float, Mapping[str, str]], CommandResult]


def subprocess_runner(argv: list[str], timeout_s: float, env: Mapping[str, str]) -> CommandResult:
    """Run one Slurm command; a timeout becomes rc=124 with a transient-looking stderr."""
    conf = env.get(SLURM_CONF)
    if conf and not os.path.exists(conf):
        # Slurm would fall back to a DNS lookup and hang until the timeout, retried as transient
        return CommandResult(argv=argv, returncode=1, stdout="",
                             stderr=f"SLURM_CONF={conf} does not exist; point it at the cluster's slurm.conf "
                                    "(for the local one: `eval $(ckptsup dev-cluster up)`)")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              env=dict(env), stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return CommandResult(argv=argv, returncode=124, stdout="",
                             stderr=f"socket timed out: {argv[0]} ran longer than {timeout_s:g}s")
    except FileNotFoundError:
        return CommandResult(argv=argv, returncode=127, stdout="",
                             stderr=f"{argv[0]}: command not found; install slurm-client (apt-get install slurm-wlm)")
    return CommandResult(argv=argv, returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)


def _errors_as_failure(result: CommandResult) -> CommandResult:
    """A `--json` answer at exit 0 with an `errors` array → a failed result whose stderr holds the
    errors; marked transient (the controller failed to answer) unless Slurm refused the request."""
    errors = parsers.json_errors(result.stdout)
    if not errors:
        return result
    text = "; ".join(errors)
    if not parsers.is_refusal(text):
        text = f"{text} (Slurm answered with errors: try again)"
    return CommandResult(argv=result.argv, returncode=1, stdout=result.stdout, stderr=text)


class _Transient(Exception):
    def __init__(self, result: CommandResult):
        super().__init__(result.stderr)
        self.result = result


class SlurmClient:
    """Slurm through its CLI. Methods and their meaning are a contract for the supervisor:

    - ``allocation_from_env(env)`` → Allocation (job id, nodes, batch host, restart count, ...)
    - ``node_info(nodes=None)`` → {node: NodeInfo(state, responding, reason)}
    - ``node_addr(node)`` → the node's NodeAddr (for the rendezvous endpoint)
    - ``job_gpus_per_node(job_id, node)`` → the job's GPUs on `node` (`scontrol show job -d`)
    - ``drain(node, reason)`` → True, or False when Slurm says permission denied (expected
      for ordinary users; never a crash); ``resume(node)`` likewise
    - ``requeue(job_id)``; ``update_job(job_id, exc_nodes=, partition=, start_time_now=)``
      (Slurm accepts ExcNodeList/Partition only while the job is pending: requeue first)
    - ``job_info(job_id)`` → JobInfo or None when Slurm no longer knows the job
    - ``cancel(job_id, signal=None, batch=False)``; ``submit(script, extra_args)`` → job id
    - ``srun_argv(nodes=, command=)`` → argv for a step the caller Popens
    """

    def __init__(self, *, env: Mapping[str, str] | None = None, runner: Runner = subprocess_runner,
                 command_timeout_s: float = 30.0, retry_budget_s: float = 60.0,
                 max_attempts: int = 20, sleep: Callable[[float], None] = time.sleep):
        self._env = dict(os.environ if env is None else env)
        self._runner = runner
        self._timeout = command_timeout_s
        self._budget = retry_budget_s
        self._max_attempts = max_attempts
        self._sleep = sleep

    @classmethod
    def from_config(cls, slurm_config, **kw) -> "SlurmClient":
        """From the `[slurm]` config section (command_timeout_s, retry_budget_s)."""
        return cls(command_timeout_s=slurm_config.command_timeout_s,
                   retry_budget_s=slurm_config.retry_budget_s, **kw)

    @property
    def env(self) -> dict[str, str]:
        return dict(self._env)

    # ---- the one place commands run ---------------------------------------------------------

    def run(self, argv: Sequence[str], *, retry: bool = True, json_answer: bool = False) -> CommandResult:
        """Run a Slurm command; retry transient failures within the budget; raise
        SlurmCommandError for a permanent failure (or when the budget is spent).

        `json_answer`: a `--json` command whose `errors` array counts as a failure even at exit 0
        (22.05 reports an unreachable controller that way); retried unless it is a refusal."""
        argv = [str(a) for a in argv]

        def once() -> CommandResult:
            result = self._runner(argv, self._timeout, self._env)
            if json_answer and result.returncode == 0:
                result = _errors_as_failure(result)
            if result.returncode != 0 and retry and parsers.is_transient(result.stderr):
                raise _Transient(result)
            return result

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_delay(self._budget) | tenacity.stop_after_attempt(self._max_attempts),
            wait=tenacity.wait_exponential(multiplier=0.2, max=5.0),
            retry=tenacity.retry_if_exception_type(_Transient),
            sleep=self._sleep, reraise=True)
        try:
            result = retrying(once)
        except _Transient as err:
            result = err.result
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).rstrip()
            hint = parsers.failure_hint(detail)
            # the error shows the last stderr line, so the fix goes on that line
            raise SlurmCommandError(argv, result.returncode, f"{detail}; {hint}" if hint else detail)
        return result

    # ---- allocation and nodes ---------------------------------------------------------------

    def allocation_from_env(self, env: Mapping[str, str] | None = None) -> Allocation:
        return allocation_from_env(self._env if env is None else env)

    def node_info(self, nodes: Sequence[str] | None = None) -> dict[str, NodeInfo]:
        argv = ["sinfo", "-h", "-N", "-o", parsers.SINFO_NODE_FORMAT]
        if nodes:
            argv += ["-n", hostlist.collect_hostlist(list(nodes))]
        return parsers.parse_sinfo_nodes(self.run(argv).stdout)

    def node_addr(self, node: str) -> str:
        return self.node_endpoint(node)[0]

    def node_endpoint(self, node: str) -> tuple[str, int | None]:
        """(NodeAddr, slurmd's port) of `node`; the port is None where scontrol does not say."""
        fields = parsers.parse_key_values(self.run(["scontrol", "show", "node", "-o", node]).stdout)
        port = fields.get("Port", "")
        return fields.get("NodeAddr") or node, int(port) if port.isdigit() and 0 < int(port) < 65536 else None

    @staticmethod
    def slurmd_answers(addr: str, port: int, timeout_s: float) -> bool:
        """Whether `node`'s slurmd accepts a TCP connection within `timeout_s` (closed at once,
        nothing sent). A dead node refuses (its port closed) or never answers (the host gone); a
        live one answers even when loaded, since the kernel completes the handshake for a listener
        that is slow to accept — so a slow agent on a live node is never taken for a dead node."""
        try:
            with socket.create_connection((addr, port), timeout=timeout_s):
                return True
        except OSError:
            return False

    def job_gpus_per_node(self, job_id: str | int, node: str = "") -> int:
        """GPUs per node of the job, from `scontrol show job -d` (for when the environment does
        not say: allocation.gpus_from_env is None)."""
        return gpus_from_scontrol(self.run(["scontrol", "show", "job", "-d", str(job_id)]).stdout, node)

    def _node_update(self, node: str, state: str, reason: str | None) -> bool:
        argv = ["scontrol", "update", f"NodeName={node}", f"State={state}"]
        if reason is not None:
            argv.append(f"Reason={reason}")
        try:
            self.run(argv)
        except SlurmCommandError as err:
            if parsers.is_permission_denied(err.stderr):
                return False
            raise
        return True

    def drain(self, node: str, reason: str) -> bool:
        """Drain `node` with `reason`. False when not permitted (ordinary users cannot drain)."""
        return self._node_update(node, "DRAIN", reason or "ckptsup")

    def resume(self, node: str) -> bool:
        """Return `node` to service. True also when it needed nothing; False when not permitted."""
        try:
            return self._node_update(node, "RESUME", None)
        except SlurmCommandError as err:
            if "invalid node state" in err.stderr.lower():
                return True  # already in service
            raise

    # ---- jobs -------------------------------------------------------------------------------

    def submit(self, script_path: str | os.PathLike[str], extra_args: Sequence[str] = ()) -> str:
        argv = ["sbatch", "--parsable", *extra_args, str(script_path)]
        return parsers.parse_sbatch_parsable(self.run(argv).stdout)

    def job_info(self, job_id: str | int) -> JobInfo | None:
        """None only when Slurm answered and does not know the job. `--states=all`: 23.02+ drop
        finished jobs from `--jobs` otherwise ("jobs": []), so a FAILED job would look gone."""
        try:
            result = self.run(["squeue", "--json", "--states=all", "--jobs", str(job_id)], json_answer=True)
        except SlurmCommandError as err:
            if "invalid job id" in err.stderr.lower():
                return None
            raise
        for job in parsers.parse_squeue_json(result.stdout):
            if job.job_id == str(job_id):
                return job
        return None

    def job_steps(self, job_id: str | int) -> list[parsers.StepInfo]:
        """The job's steps Slurm still holds: running, or completing (a step's nodes report its end
        up a tree; step_completion.py)."""
        try:
            result = self.run(["squeue", "--noheader", "--steps", "--jobs", str(job_id),
                               f"--format={parsers.STEP_FORMAT}"])
        except SlurmCommandError as err:
            if "invalid job id" in err.stderr.lower():   # the job is gone, and its steps with it
                return []
            raise
        return parsers.parse_squeue_steps(result.stdout)

    def requeue(self, job_id: str | int) -> None:
        """`scontrol requeue`: Slurm then holds the job for ~121 s (BeginTime); lift it with
        update_job(start_time_now=True)."""
        self.run(["scontrol", "requeue", str(job_id)])

    def release(self, job_id: str | int) -> None:
        """Release a job submitted with --hold."""
        self.run(["scontrol", "release", str(job_id)])

    def update_job(self, job_id: str | int, *, exc_nodes: Sequence[str] | None = None,
                   partition: str | None = None, start_time_now: bool = False) -> None:
        """One `scontrol update` with the given fields. ExcNodeList and Partition are refused
        on a running job ('Job is no longer pending execution'): requeue first."""
        argv = ["scontrol", "update", f"JobId={job_id}"]
        if exc_nodes is not None:
            argv.append(f"ExcNodeList={hostlist.collect_hostlist(list(exc_nodes))}" if exc_nodes else "ExcNodeList=")
        if partition:
            argv.append(f"Partition={partition}")
        if start_time_now:
            argv.append("StartTime=now")
        if len(argv) == 3:
            return
        self.run(argv)

    def cancel(self, job_id: str | int, *, signal: str | None = None, batch: bool = False,
               full: bool = False) -> None:
        """scancel; with `signal` only signals (e.g. USR1 to simulate the time-limit warning,
        with batch=True to reach the batch shell only)."""
        argv = ["scancel"]
        if signal:
            argv.append(f"--signal={signal}")
        if batch:
            argv.append("--batch")
        if full:
            argv.append("--full")
        argv.append(str(job_id))
        self.run(argv)

    def accounting(self, job_id: str | int) -> list[dict[str, str]]:
        """Finished-job records from `sacct` (JobID, State, ExitCode, NodeList, Start, End).
        Clusters without accounting storage (the dev cluster) answer from the job-completion
        log instead (`sacct -c`)."""
        fields = ["JobID", "State", "ExitCode", "NodeList", "Start", "End"]
        argv = ["sacct", "-n", "-P", "-j", str(job_id), "-o", ",".join(fields)]
        try:
            out = self.run(argv).stdout
        except SlurmCommandError as err:
            if "accounting storage is disabled" not in err.stderr.lower():
                raise
            out = self.run([argv[0], "-c", *argv[1:]]).stdout
        return parsers.parse_sacct(out, fields)

    def ping(self) -> bool:
        try:
            return "UP" in self.run(["scontrol", "ping"], retry=False).stdout
        except SlurmCommandError:
            return False

    # ---- steps the caller runs itself -------------------------------------------------------

    @staticmethod
    def srun_argv(*, nodes: Sequence[str], command: Sequence[str], ntasks_per_node: int = 1,
                  overlap: bool = True, input_all: bool = True,
                  job_id: str | None = None, extra: Sequence[str] = ()) -> list[str]:
        """argv of `srun` for a step of one task per node on `nodes` (e.g. the agents):
        `--overlap` so it starts while an old step on a dead node is still completing;
        `--input=all` so the supervisor can write commands to every agent's stdin;
        never `-u`: without it srun keeps each task's lines of up to 1 KiB whole (with it, tasks
        write to a pty and any line may be cut and interleaved with another task's; lines arrive
        at once either way, measured: step_lines.py). The caller Popens it (never blocking here)."""
        count = len(nodes)
        argv = ["srun"]
        if overlap:
            argv.append("--overlap")
        if input_all:
            argv.append("--input=all")
        if job_id:
            argv.append(f"--jobid={job_id}")
        argv += [f"--nodes={count}", f"--ntasks={count * ntasks_per_node}",
                 f"--ntasks-per-node={ntasks_per_node}",
                 f"--nodelist={hostlist.collect_hostlist(list(nodes))}", *extra, *command]
        return argv
