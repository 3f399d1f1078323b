"""Warm rank interpreters (docs/supervisor.md §Warm restarts): a Python process that has already
imported torch waits on a Unix socket for one rank to become.

The agent keeps one per local rank (`WarmPool`), forked by its zygote (rankside/zygote.py), which
imported torch with the environment the ranks will have (variables such as OMP_NUM_THREADS are
read at import). torchrun then runs
`warm_proxy` as each worker (`--no-python`): the proxy hands the warm interpreter its argv,
environment, working directory and standard streams (SCM_RIGHTS), forwards signals, and exits
with the rank's exit status. A restart so skips the interpreter's and torch's start-up.

Not run on its own: the zygote forks it and calls `listen` then `serve`. Torch is imported in
rank-side processes only, never in the agent or the supervisor.

Wire (one connection, then the process is the rank): proxy → warm: one JSON line {argv, env,
cwd, module} with fds 0, 1, 2 attached; warm → proxy: {"pid"}, later {"rc"}; the connection
closes when the rank's process exits (after its atexit handlers).
"""

from __future__ import annotations

import array
import io
import json
import os
import signal
import socket
import struct
import sys
import threading

REQUEST_MAX = 4 << 20     # argv + environment: far below this
ACCEPT_FDS = 3


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One newline-terminated JSON object and the fds sent with its first bytes (bounded)."""
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        msg, anc, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(ACCEPT_FDS * fds.itemsize))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        if not msg:
            raise ConnectionError("the proxy closed before its request")
        data += msg
        if len(data) > REQUEST_MAX:
            raise ValueError("request too large")
    from ..errors import CkptsupError
    from ..safe_io import loads_json

    try:
        request = loads_json(data, what="warm rank request", error=CkptsupError, max_depth=8)
    except CkptsupError as err:
        raise ValueError(str(err)) from None
    if not isinstance(request, dict):
        raise ValueError("request is not an object")
    return request, list(fds)


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (OSError, struct.error):
        return None
    return uid


def die_with_parent() -> None:
    """The agent is our parent: if it dies (SIGKILL skips its cleanup), we die too."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _watch_proxy(conn: socket.socket) -> None:
    """The proxy is the worker torchrun knows: when it is gone (killed), so is this rank."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _exit_code(err: SystemExit) -> int:
    code = err.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def become_rank(request: dict, fds: list[int], conn: socket.socket) -> int:
    """Take the rank's streams, environment, cwd and argv, and run its script as __main__."""
    import traceback

    from .script_main import run_script

    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    env = request.get("env") or {}
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    os.chdir(str(request.get("cwd") or "."))
    argv = [str(a) for a in request.get("argv") or []]
    from ..env import set_rank_title

    # ps, py-spy and kill find the rank here, not in its proxy: this process's own argv is warm_rank's
    set_rank_title(os.environ.get("RANK", "?"), (["-m"] if request.get("module") else []) + argv)
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    threading.Thread(target=_watch_proxy, args=(conn,), name="warm-proxy-watch", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)   # the script installs its own handlers, as in a cold start
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from ..stack_dump import install

    install()   # the agent can ask where this rank is (a hang's evidence), even blocked inside C
    try:
        run_script(argv, module=bool(request.get("module")))
        code = 0
    except SystemExit as err:
        code = _exit_code(err)
    except BaseException:  # noqa: BLE001 — the script's own exception: its traceback, exit 1, as python does
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        conn.sendall(json.dumps({"rc": code}).encode() + b"\n")
    except OSError:
        pass
    exit_now(code)
    return code   # not reached


def exit_now(code: int) -> None:
    """Python's own exit, less the teardown of the modules: the script's non-daemon threads are
    joined and its atexit handlers run (DataLoader workers, loggers, our hooks' last save), then
    its garbage is collected — a file it never closed is flushed by its finaliser, as at a normal
    exit — and the process ends. Tearing down torch's and dynamo's module graph cost ~0.8 s of CPU
    per rank here (several seconds on a loaded node), paid at every run's end and every fast-path
    restart, while the proxy, torchrun and the agent wait for the rank's socket to close."""
    import atexit
    import gc

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except BaseException:  # noqa: BLE001 — as at python's exit: reported, the status stands
            import traceback

            traceback.print_exc()
    atexit._run_exitfuncs()   # prints its handlers' own exceptions, as python does
    atexit._clear()
    # files the script still holds open, flushed while alive: the collector finalises a garbage
    # cycle's objects in no set order, and a buffer closed before its text wrapper loses the text.
    # The zygote froze what it imported (gc.freeze), so only the script's objects are walked.
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                obj.flush()
            except (OSError, ValueError):
                pass
    gc.collect()   # the script's other finalisers (weakref.finalize's, __del__), as at python's exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)   # C++ code's buffered stdio (torch's, an extension's)
    except (OSError, AttributeError):
        pass
    os._exit(code)


# imported ahead of need: torch (~1.4 s here), DCP and ckptsup's hooks (~0.9 s more); the script's
# own `import torch` then costs nothing. Whatever a script does not use is merely loaded.
# The rest is what a warm DDP rank still imported between its start and its first step after a
# restart (sys.modules compared): DistributedDataParallel's constructor imports torch._dynamo
# (~0.6 s here, 1.8 s on a busy node) and the comm hooks, rank 0's attach the checkpoint
# housekeeper (tenacity: ~0.13 s), the resume DCP's state_dict helpers; ~1 s of a restart in all.
PREIMPORTS = ("torch", "torch.distributed", "torch.distributed.checkpoint", "ckptsup.hooks.session",
              "torch._dynamo", "torch.distributed.algorithms.ddp_comm_hooks", "torch.distributed.checkpoint.state_dict",
              "torch.utils.serialization", "torchdata.stateful_dataloader", "ckptsup.checkpoint.housekeeping",
              "ckptsup.hooks.loader", "ckptsup.rankside.script_main", "ckptsup.stack_dump", "setproctitle")


def preimport(names: tuple[str, ...]) -> None:
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            continue


def listen(path: str) -> socket.socket:
    """The socket a proxy connects to (0600 in the agent's 0700 dir)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(1)
    return server


def serve(server: socket.socket, path: str) -> int:
    """Say ready (torch is in), wait for the one proxy that hands this interpreter its rank, and
    become that rank: its exit status is returned."""
    from ..env import prepare_rank_title

    prepare_rank_title()   # now: the rank's environment replaces ours, and setproctitle needs ours
    with open(path + ".ready", "w"):
        pass   # the agent hands this interpreter out only once torch is in
    while True:
        conn, _ = server.accept()
        if _peer_uid(conn) != os.getuid():
            conn.close()   # another user cannot reach a 0700 dir; belt and braces
            continue
        try:
            request, fds = recv_request(conn)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            continue
        if len(fds) != 3 or not request.get("argv"):
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        server.close()
        os.unlink(path)
        return become_rank(request, fds, conn)
