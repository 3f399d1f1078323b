"""A real multi-node Slurm cluster on one machine (docs/slurm.md §The dev cluster), all of it under
one directory.

Daemons: our own munged (own key and socket: the system's munge is never touched), slurmctld,
and one slurmd per node, each as PID 1's child in its own PID, mount and UTS namespace:

    unshare --pid --fork --mount-proc --uts --kill-child tini -- sh -c 'hostname nK; exec slurmd -D ...'

so killing that namespace's PID 1 (tini, which also reaps slurmstepd zombies) kills every process
of the node at once: a realistic node death. Each daemon we start is recorded in DIR/run/NAME.json
(pid + start time), and `down` stops exactly those processes, nothing found by name.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from ..env import SLURM_CONF
from ..errors import DevClusterError
from .client import SlurmClient
from .daemons import Daemon, not_zombie, reap, start_ticks
from .devconf import (ClusterSpec, parse_slurm_version, render_bundle_config, render_cgroup_conf, render_gres_conf,
                      render_oci_conf, render_slurm_conf)
from .parsers import NodeInfo, NodeState

REQUIRED_COMMANDS = ("slurmctld", "slurmd", "munged", "tini", "unshare", "mount", "scontrol", "sinfo", "sbatch", "squeue")
INSTALL_HINT = "apt-get install slurm-wlm munge tini"
UP_TIMEOUT_S = 15.0                 # 5 nodes
UP_TIMEOUT_PER_NODE_S = 1.0         # each node past 5 (measured: 16 nodes up in 0.4 s, 256 in 3.4 s; docs/slurm.md)


def slurm_version() -> tuple[int, int]:
    """The installed Slurm's (major, minor), from `slurmd -V`."""
    try:
        out = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=10, check=False)
        return parse_slurm_version(out.stdout + out.stderr)
    except (OSError, subprocess.TimeoutExpired, ValueError) as err:
        raise DevClusterError(f"cannot tell the Slurm version (`slurmd -V`: {err}); install with: {INSTALL_HINT}") from None


# hidden inside the test bundle: no agent may run a Slurm command (drains, requeues, queries are the supervisor's)
SLURM_COMMANDS = ("srun", "sbatch", "scontrol", "squeue", "sinfo", "scancel", "sacct", "salloc")


def _under(path: str, tops: list[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


def _outermost(paths: list[str]) -> list[str]:
    """The paths without those inside another of them (one bind serves both)."""
    unique = list(dict.fromkeys(paths))
    return [p for p in unique if not _under(p, [o for o in unique if o != p])]


def missing_commands() -> list[str]:
    return [c for c in REQUIRED_COMMANDS if shutil.which(c) is None
            and not Path("/usr/sbin", c).exists()]


@dataclass(frozen=True, kw_only=True)
class ClusterStatus:
    dir: str
    conf: str
    daemons: dict[str, int | None]       # name → pid when alive, None when not running
    nodes: dict[str, NodeInfo]

    def to_dict(self) -> dict:
        return {"dir": self.dir, "conf": self.conf, "daemons": self.daemons,
                "nodes": {n: {"state": i.state.value, "responding": i.responding, "reason": i.reason}
                          for n, i in self.nodes.items()}}


class DevCluster:
    """Operations on the cluster described by `spec`. Every method is safe to repeat."""

    def __init__(self, spec: ClusterSpec, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.spec = spec
        self._clock = clock
        self._sleep = sleep

    # ---- paths and environment ----------------------------------------------------------------

    @property
    def conf(self) -> Path:
        return self.spec.conf

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[SLURM_CONF] = str(self.conf)
        return env

    def client(self) -> SlurmClient:
        return SlurmClient(env=self.env(), command_timeout_s=10, retry_budget_s=10)

    def _record_path(self, name: str) -> Path:
        return self.spec.dir / "run" / f"{name}.json"

    def _daemon(self, name: str) -> Daemon | None:
        try:
            data = json.loads(self._record_path(name).read_text())
            return Daemon(name=name, pid=int(data["pid"]), start_ticks=int(data["start_ticks"]))
        except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError, TypeError):
            # a record of an older version (create_time) reads as not running: a PID alone may be reused
            return None

    def _alive(self, name: str) -> psutil.Process | None:
        daemon = self._daemon(name)
        return daemon.process() if daemon else None

    def _recorded_nodes(self) -> list[str]:
        """Nodes with a daemon record in DIR/run, the spec's and any other (a bigger cluster that ran
        in this directory before): `down` and the checks stop or see every one of them."""
        recorded = [p.stem.removeprefix("node-") for p in (self.spec.dir / "run").glob("node-*.json")]
        extra = sorted((n for n in recorded if n not in self.spec.node_names), key=lambda n: (len(n), n))
        return self.spec.node_names + extra

    def _names(self) -> list[str]:
        return ["munged", "slurmctld"] + [f"node-{n}" for n in self._recorded_nodes()]

    # ---- up -----------------------------------------------------------------------------------

    def up(self, *, timeout_s: float | None = None) -> float:
        """Start whatever is not running and wait until every node responds and is usable (within
        `timeout_s`; by default 15 s and 1 s more per node past 5). Returns the seconds it took."""
        start = self._clock()
        if timeout_s is None:
            timeout_s = UP_TIMEOUT_S + UP_TIMEOUT_PER_NODE_S * max(0, self.spec.nodes - 5)
        missing = missing_commands()
        if missing:
            raise DevClusterError(f"missing {', '.join(missing)}; install with: {INSTALL_HINT}")
        if os.geteuid() != 0:
            raise DevClusterError("the dev cluster needs root (PID/UTS namespaces, SlurmUser=root); run it as root")
        fresh = not any(self._alive(n) for n in self._names())
        if fresh:
            self._check_ports_free()
        try:
            self._prepare_dirs(fresh=fresh)
        except OSError as err:
            raise DevClusterError(f"cannot prepare the cluster directory {self.spec.dir}: {err.strerror} "
                                  f"({err.filename}); choose a writable --dir") from None
        if self._alive("munged") is None:
            self._start_munged()
        if self._alive("slurmctld") is None:
            # in a mount namespace of its own with the cluster's hosts file, as the nodes have:
            # 24.11+ look up a client's host (srun's node) by name, ~10 s per failed lookup
            self._start("slurmctld", ["unshare", "--mount", "sh", "-c",
                                      f"mount --bind {shlex.quote(str(self._hosts()))} /etc/hosts && "
                                      f"exec slurmctld -D -i -f {shlex.quote(str(self.conf))}"])
            self._wait_ctld(start + timeout_s)
        for node in self.spec.node_names:
            if self._alive(f"node-{node}") is None:
                self._start_node(node)
        self._wait_nodes_ready(self.spec.node_names, start + timeout_s)
        return self._clock() - start

    def _check_ports_free(self) -> None:
        for port in self.spec.ports():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                # as Slurm does: connections of a previous cluster in TIME_WAIT do not count
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    raise DevClusterError(f"port {port} on 127.0.0.1 is in use (another cluster?); "
                                          f"choose another --port-base than {self.spec.port_base}") from None

    def _prepare_dirs(self, *, fresh: bool) -> None:
        d = self.spec.dir
        # 0711: other users may reach the munge socket and slurm.conf (as on a real cluster),
        # but list nothing; the state directories themselves are 0700.
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o711)
        for sub in ("run", "ctld", "munge", "logs"):
            (d / sub).mkdir(exist_ok=True)
            os.chmod(d / sub, 0o711 if sub == "munge" else 0o700)
        if fresh:  # job ids restart at FirstJobId on a fresh cluster: old records would collide
            shutil.rmtree(d / "ctld" / "state", ignore_errors=True)
            (d / "ctld" / "jobcomp.txt").unlink(missing_ok=True)
        (d / "ctld" / "state").mkdir(mode=0o700, exist_ok=True)
        (d / "nodes").mkdir(mode=0o755, exist_ok=True)
        for node in self.spec.node_names:
            nd = self.spec.node_dir(node)
            if fresh:
                shutil.rmtree(nd / "spool", ignore_errors=True)
            (nd / "spool").mkdir(parents=True, exist_ok=True)
            self.spec.node_local_dir(node).mkdir(exist_ok=True)
            os.chmod(nd, 0o755)
            os.chmod(self.spec.node_local_dir(node), 0o1777)  # like a node's /tmp-style scratch
        if fresh:
            self._write_hosts()
        self._make_gpu_devices()
        text = render_slurm_conf(self.spec)
        if self.conf.exists() and self.conf.read_text() != text and not fresh:
            raise DevClusterError(f"a cluster is running in {d} with another configuration; "
                                  f"run `ckptsup dev-cluster down --dir {d}` first")
        self.conf.write_text(text)
        os.chmod(self.conf, 0o644)
        self.spec.gres_conf.write_text(render_gres_conf(self.spec))
        os.chmod(self.spec.gres_conf, 0o644)
        cgroup = render_cgroup_conf(slurm_version())
        if cgroup is None:
            self.spec.cgroup_conf.unlink(missing_ok=True)
        else:
            self.spec.cgroup_conf.write_text(cgroup)
            os.chmod(self.spec.cgroup_conf, 0o644)
        if self.spec.containers:
            self._write_containers()
        else:
            self.spec.oci_conf.unlink(missing_ok=True)

    def _write_containers(self) -> None:
        """oci.conf with runc, and the test bundle: the host's system directories, this ckptsup and
        its virtual environment read-only, /tmp and the cluster directory writable."""
        if shutil.which("runc") is None:
            raise DevClusterError("--containers needs runc; install it with: apt-get install runc")
        self.spec.oci_conf.write_text(render_oci_conf(self.spec))
        os.chmod(self.spec.oci_conf, 0o644)
        self.spec.runc_root.mkdir(mode=0o700, exist_ok=True)
        rootfs = self.spec.bundle / "rootfs"
        rootfs.mkdir(parents=True, exist_ok=True)
        package_root = str(Path(__file__).resolve().parents[2])
        binds = _outermost([package_root, os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)])
        writable = _outermost(["/tmp", str(self.spec.dir)])
        slurm = [path for c in SLURM_COMMANDS if (path := shutil.which(c))]
        config = render_bundle_config(binds=[b for b in binds if not _under(b, ["/usr", *writable])], writable=writable,
                                      hide=[os.path.realpath(p) for p in slurm])
        (self.spec.bundle / "config.json").write_text(json.dumps(config, indent=1))

    def _make_gpu_devices(self) -> None:
        """Fake GPUs for the GRES: character devices (major 195, as NVIDIA's) under the cluster
        directory, so nothing else on this machine sees them. Slurm only stats them (task/none
        constrains no device); opening one would fail, as no driver owns the major."""
        devices = self.spec.gpu_devices()
        if not devices:
            return
        (self.spec.dir / "dev").mkdir(mode=0o755, exist_ok=True)
        for minor, path in enumerate(devices):
            if path.exists() and path.is_char_device():
                continue
            path.unlink(missing_ok=True)
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(195, minor))

    def _start(self, name: str, argv: list[str], **popen) -> subprocess.Popen:
        log = open(self.spec.dir / "logs" / f"{name}.out", "ab")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    env=self.env(), start_new_session=True, close_fds=True, **popen)
        except OSError as err:
            raise DevClusterError(f"cannot start {argv[0]}: {err}; install with: {INSTALL_HINT}") from None
        finally:
            log.close()
        record = self._record_path(name)
        record.write_text(json.dumps({"pid": proc.pid, "start_ticks": start_ticks(proc.pid), "argv": argv}))
        return proc

    def _start_munged(self) -> None:
        m = self.spec.dir / "munge"
        key = m / "munge.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as fh:
                fh.write(os.urandom(1024))
        # -f: our socket lives under a 0711 tree that munged's own checks would refuse
        self._start("munged", ["munged", "-F", "-f", f"--socket={self.spec.munge_socket}",
                               f"--key-file={key}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        deadline = self._clock() + 5
        while not self.spec.munge_socket.exists():
            if self._alive("munged") is None:
                raise DevClusterError(f"munged exited at start; see {m / 'munged.log'}")
            if self._clock() > deadline:
                raise DevClusterError(f"munged did not create its socket; see {m / 'munged.log'}")
            self._sleep(0.02)

    def _write_hosts(self) -> Path:
        """/etc/hosts for the nodes' mount namespaces: the host's entries plus every node name
        on loopback, so daemons and jobs resolve n1..nN (slurmd binds to what its name resolves
        to: no listener on 0.0.0.0; torchrun's advertised hostname resolves too)."""
        try:
            base = Path("/etc/hosts").read_text()
        except OSError:
            base = "127.0.0.1 localhost\n"
        hosts = self.spec.dir / "hosts"
        hosts.write_text(base.rstrip("\n") + "\n# ckptsup dev cluster nodes\n127.0.0.1 "
                         + " ".join(self.spec.node_names) + "\n")
        os.chmod(hosts, 0o644)
        return hosts

    def _hosts(self) -> Path:
        hosts = self.spec.dir / "hosts"
        return hosts if hosts.exists() else self._write_hosts()

    def _start_node(self, node: str) -> None:
        nd = self.spec.node_dir(node)
        # a node that starts has no containers, as after a reboot (runc's state lives in a tmpfs
        # there): a killed node's would make the same id of a requeued job's step "already exist"
        shutil.rmtree(self.spec.runc_root / node, ignore_errors=True)
        hosts = self._hosts()
        # the bind mount lives only in this node's private mount namespace
        q = shlex.quote
        script = (f"mount --bind {q(str(hosts))} /etc/hosts && hostname {q(node)} && "
                  f"exec slurmd -D -f {q(str(self.conf))} -N {q(node)}")
        self._start(f"node-{node}", ["unshare", "--pid", "--fork", "--mount-proc", "--uts",
                                     "--kill-child", "tini", "--", "sh", "-c", script], cwd=nd)

    def _wait_ctld(self, deadline: float) -> None:
        client = self.client()
        while not client.ping():
            if self._alive("slurmctld") is None:
                raise DevClusterError(f"slurmctld exited at start: {self._log_tail('ctld/slurmctld.log')}")
            if self._clock() > deadline:
                raise DevClusterError(f"slurmctld does not answer; see {self.spec.dir / 'ctld/slurmctld.log'}")
            self._sleep(0.1)

    def _wait_nodes_ready(self, nodes: list[str], deadline: float) -> dict[str, NodeInfo]:
        client = self.client()
        resumed: set[str] = set()
        while True:
            info = client.node_info()
            ready = {n for n in nodes if n in info and info[n].healthy}
            if len(ready) == len(nodes):
                return info
            for n in nodes:
                # a node that came back while Slurm still marks it DOWN/DRAINED: resume it once
                if n in info and info[n].responding and n not in resumed and \
                        info[n].state in (NodeState.DOWN, NodeState.DRAINED, NodeState.FAIL):
                    client.resume(n)
                    resumed.add(n)
            if self._clock() > deadline:
                states = ", ".join(f"{n}={info[n].raw_state if n in info else '?'}" for n in nodes)
                raise DevClusterError(f"nodes not ready in time ({states}); see {self.spec.dir}/nodes/*/slurmd.log")
            self._sleep(0.1)

    def _log_tail(self, rel: str) -> str:
        try:
            lines = (self.spec.dir / rel).read_text(errors="replace").strip().splitlines()
            return lines[-1] if lines else "(empty log)"
        except OSError:
            return f"(no log at {self.spec.dir / rel})"

    # ---- nodes --------------------------------------------------------------------------------

    def node_init(self, node: str) -> psutil.Process | None:
        """The node's namespace PID 1 (tini) as seen from the host."""
        outer = self._alive(f"node-{node}")
        if outer is None:
            return None
        children = outer.children()
        return children[0] if children else None

    def node_pids(self, node: str) -> list[int]:
        """Host PIDs of every process of `node` (all of its PID namespace)."""
        init = self.node_init(node)
        if init is None:
            return []
        try:
            ns = os.readlink(f"/proc/{init.pid}/ns/pid")
        except OSError:
            return []
        pids = []
        for proc in psutil.process_iter():
            try:
                if os.readlink(f"/proc/{proc.pid}/ns/pid") == ns:
                    pids.append(proc.pid)
            except (OSError, psutil.Error):
                continue
        return pids

    def _check_node(self, node: str) -> None:
        if node not in self.spec.node_names:
            raise DevClusterError(f"unknown node {node!r}; nodes: {', '.join(self.spec.node_names)}")

    def node_running(self, node: str) -> bool:
        """Whether NODE's daemon (its namespace) is alive."""
        self._check_node(node)
        return self._alive(f"node-{node}") is not None

    def kill_node(self, node: str, *, timeout_s: float = 5.0) -> float:
        """SIGKILL the node's namespace PID 1: the kernel kills every process of the node at
        once. Returns seconds until none is left."""
        self._check_node(node)
        return self._kill_node(node, timeout_s=timeout_s)

    def _kill_node(self, node: str, *, timeout_s: float = 5.0) -> float:
        start = self._clock()
        init = self.node_init(node)
        pids = self.node_pids(node)
        outer = self._daemon(f"node-{node}")
        # before its namespace exists (just started), the outer unshare is the node: --kill-child
        # takes the child along
        target = init or (outer.process() if outer else None)
        if target is None:
            self._record_path(f"node-{node}").unlink(missing_ok=True)
            return 0.0
        try:
            target.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
        deadline = start + timeout_s
        while True:
            if outer is not None:
                reap(outer.pid)
            left = [p for p in pids if psutil.pid_exists(p) and not_zombie(p)]
            if not left and (outer is None or outer.process() is None):
                break
            if self._clock() > deadline:
                raise DevClusterError(f"{node}: processes {left} survived SIGKILL of the namespace")
            self._sleep(0.01)
        self._record_path(f"node-{node}").unlink(missing_ok=True)
        return self._clock() - start

    def revive_node(self, node: str, *, timeout_s: float = 30.0) -> float:
        """Start the node again and return it to service (resume when Slurm still has it
        DOWN). Returns seconds until it is usable."""
        self._check_node(node)
        start = self._clock()
        if self._alive("slurmctld") is None:
            raise DevClusterError(f"the cluster in {self.spec.dir} is not up; run `ckptsup dev-cluster up` first")
        if self._alive(f"node-{node}") is None:
            self._start_node(node)
        self._wait_nodes_ready([node], start + timeout_s)
        return self._clock() - start

    # ---- down / status ------------------------------------------------------------------------

    def down(self, *, timeout_s: float = 10.0) -> float:
        """Stop every daemon this cluster started (by recorded PID), nodes first."""
        start = self._clock()
        for node in self._recorded_nodes():
            self._kill_node(node) if self._alive(f"node-{node}") else self._record_path(f"node-{node}").unlink(missing_ok=True)
        for name in ("slurmctld", "munged"):
            self._stop(name, start + timeout_s)
        return self._clock() - start

    def _stop(self, name: str, deadline: float) -> None:
        daemon = self._daemon(name)
        proc = daemon.process() if daemon else None
        if daemon is not None and proc is not None:
            proc.terminate()
            while daemon.process() is not None:
                if self._clock() > deadline:
                    proc.kill()  # slurmctld may take long to save state; its state is disposable
                    deadline += 5
                self._sleep(0.02)
        self._record_path(name).unlink(missing_ok=True)

    def status(self) -> ClusterStatus:
        daemons = {}
        for name in self._names():
            proc = self._alive(name)
            daemons[name] = proc.pid if proc else None
        nodes: dict[str, NodeInfo] = {}
        if daemons["slurmctld"] is not None:
            nodes = self.client().node_info()
        return ClusterStatus(dir=str(self.spec.dir), conf=str(self.conf), daemons=daemons, nodes=nodes)

    def running_pids(self) -> list[int]:
        """Every live process this cluster started, including the nodes' namespaces."""
        pids = []
        for name in self._names():
            proc = self._alive(name)
            if proc is not None:
                pids.append(proc.pid)
        for node in self._recorded_nodes():
            pids += self.node_pids(node)
        return sorted(set(pids))
