"""A node's pre-imported interpreter (docs/supervisor.md §Warm restarts). The node agent starts one
(supervisor/node/zygote.py is its handle); it imports torch, torchrun, DCP and ckptsup's hooks
once, then forks on request:
- `warm`: a warm rank interpreter (warm_rank.serve: it listens on PATH until a proxy hands it
  its rank);
- `torchrun`: torchrun itself (torchrun_standby.become_torchrun), its stdout and stderr the fd
  sent with the request.
A node so pays one torch import for all its restarts, not one per rank and per launch, and its
children share the imported pages copy-on-write.

Parentage: each child is forked twice and the middle process exits at once, so the kernel
reparents the child to the agent, a child subreaper (PR_SET_CHILD_SUBREAPER): the agent waits
on it and reads its exit status as from a Popen, and a stopped or dead zygote holds up no rank.
A warm interpreter dies with the agent (PDEATHSIG, set once it is the agent's).

Wire (a socketpair, ours passed as `--control FD`): zygote → agent: {"ready": true} once the
imports are done; agent → zygote: one JSON line {"kind": "warm"|"torchrun", ...} with the fds
it needs; zygote → agent: {"pid": N} or {"error": "..."}.

Run as `python -m ckptsup.rankside.zygote --control FD`. Rank side: it imports torch.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import struct
import sys
import time
from typing import Callable

from ..env import ForkKind, set_torchrun_title, set_warm_title
from . import warm_rank

# the ranks' imports (warm_rank.PREIMPORTS), numpy's generators (scripts seed or draw from them),
# and torchrun's, for the torchrun children
PREIMPORTS = (*warm_rank.PREIMPORTS, "numpy.random", "torch.distributed.run",
              "torch.distributed.elastic.multiprocessing.errors")
REPARENT_WAIT_S = 5.0   # the middle process exits at once; the agent is our parent within microseconds
Role = Callable[[], int]


def _reply(conn: socket.socket, body: dict) -> None:
    conn.sendall(json.dumps(body).encode() + b"\n")


def _role(request: dict, fds: list[int]) -> Role:
    if request.get("kind") == ForkKind.TORCHRUN:
        return _torchrun_role(request, fds)
    for fd in fds:
        os.close(fd)
    return _warm_role(request)


def _warm_role(request: dict) -> Role:
    path, cwd = str(request["listen"]), str(request.get("cwd") or ".")
    os.chdir(cwd)
    server = warm_rank.listen(path)
    # ps tells a waiting interpreter by its title: a forked child's /proc environ is the zygote's
    set_warm_title(int(request.get("local_rank", 0)), path)
    return lambda: warm_rank.serve(server, path)


def _torchrun_role(request: dict, fds: list[int]) -> Role:
    from .torchrun_standby import become_torchrun

    out = fds[0]
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    argv = [str(a) for a in request["argv"]]
    body = {"argv": argv, "env": {str(k): str(v) for k, v in request["env"].items()}, "cwd": str(request["cwd"])}
    set_torchrun_title(argv)   # ps: torchrun, not the zygote it was forked from
    return lambda: become_torchrun(body)


def _as_agents_child(agent: int, *, die_with_it: bool) -> None:
    """In the grandchild: wait until the kernel made the agent our parent; a warm interpreter then
    dies with it, as one the agent started itself would. torchrun does not: as when the agent
    started it, a dead agent's ranks are stopped by whoever outlives it (the supervisor's
    orphan kill, the step's end). The process is a session leader, as a
    Popen(start_new_session=True) child would be."""
    os.setsid()
    deadline = time.monotonic() + REPARENT_WAIT_S
    while os.getppid() != agent:
        if time.monotonic() > deadline:
            os._exit(1)   # the agent is gone (or not a subreaper): nobody would wait on us
        time.sleep(0.0005)
    if die_with_it:
        warm_rank.die_with_parent()
        if os.getppid() != agent:
            os._exit(1)   # the agent died between the check and the prctl
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()   # fork copies numpy's global generator: every child would draw the same numbers


def _fork(agent: int, control: socket.socket, request: dict, fds: list[int]) -> tuple[int, Role | None]:
    """Fork twice; in the zygote: (the grandchild's pid, None); in the grandchild: (0, its role)."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            child = os.fork()
        except BaseException:  # noqa: BLE001 — the middle process never returns into the zygote's loop
            os._exit(1)
        if child == 0:
            try:
                os.close(r)
                os.close(w)
                control.close()
                _as_agents_child(agent, die_with_it=request.get("kind") != ForkKind.TORCHRUN)
                return 0, _role(request, fds)
            except BaseException:  # noqa: BLE001 — nor does the child before its role starts
                os._exit(1)
        try:
            os.write(w, struct.pack("i", child))
        finally:
            os._exit(0)   # the middle process: its child is the agent's once it is gone
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read(4)
    os.waitpid(middle, 0)   # reaped: the grandchild has been reparented to the agent
    for fd in fds:
        os.close(fd)
    if len(data) != 4:
        raise OSError("the middle process died before it forked")
    return struct.unpack("i", data)[0], None


def serve(control: socket.socket, agent: int) -> Role | None:
    """Answer fork requests until the agent closes the connection (None). Returns in a forked
    child only: the role it is to play, run by main() once the zygote's frames are gone."""
    _reply(control, {"ready": True})
    while True:
        try:
            request, fds = warm_rank.recv_request(control)
        except ConnectionError:
            return None   # the agent closed us
        except (OSError, ValueError) as err:
            _reply(control, {"error": f"bad request: {err}"})
            continue
        kind = request.get("kind")
        if kind not in tuple(ForkKind) or (kind == ForkKind.TORCHRUN and len(fds) != 1) \
                or (kind == ForkKind.WARM and "listen" not in request):
            for fd in fds:
                os.close(fd)
            _reply(control, {"error": f"bad request: kind {kind!r} with {len(fds)} fds"})
            continue
        try:
            pid, role = _fork(agent, control, request, fds)
        except OSError as err:
            _reply(control, {"error": f"fork failed: {err}"})
            continue
        if role is not None:
            return role
        _reply(control, {"pid": pid})


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2 or args[0] != "--control" or not args[1].isdigit():
        print("usage: python -m ckptsup.rankside.zygote --control FD", file=sys.stderr)
        return 2
    agent = os.getppid()
    warm_rank.die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's ^C is the agent's to handle
    control = socket.socket(fileno=int(args[1]))
    warm_rank.preimport(PREIMPORTS)
    # what the imports made lives as long as the ranks: the collector never walks it again (a
    # rank's collections and its exit's walk only the script's objects) and fork keeps it shared
    gc.freeze()

    role = serve(control, agent)
    if role is None:
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return role()


if __name__ == "__main__":
    sys.exit(main())
