"""The worker torchrun runs when warm interpreters are ready (`torchrun --no-python python -S
.../ckptsup/rankside/warm_proxy.py SCRIPT ARGS`): it hands its rank over to the warm interpreter
of its local rank (rankside/warm_rank.py) and stands in for it — signals forwarded, the rank's
exit status its own. Without a ready warm interpreter it becomes the rank cold (exec
rankside/cold_rank.py).

It is on every warm restart's path, once per rank, so it starts as little as possible: run as a
file with `-S` (no site: no site-packages, no editable finders) and the standard library only —
~20 ms to its first line here instead of ~80 ms as `-m ckptsup.rankside.warm_proxy` (site, the
package, env.py's dataclasses). The names below are env.py's (tests/test_warm_proxy_start.py
holds them equal); the cold rank it may exec is a full interpreter again.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
HELLO_TIMEOUT_S = 5.0   # a ready warm interpreter answers in milliseconds; a stopped or stuck one never does
WARM_DIR = "CKPTSUP_WARM_DIR"             # env.WARM_DIR
RANK_MODULE_FLAG = "--ckptsup-module"     # env.RANK_MODULE_FLAG


def cold_rank_argv(python: str, argv: list[str], *, module: bool) -> list[str]:
    """env.cold_rank_argv: python running rankside/cold_rank.py (with site, as any rank)."""
    return [python, "-u", "-m", "ckptsup.rankside.cold_rank", *([RANK_MODULE_FLAG] if module else []), *argv]


def split_module_flag(args: list[str]) -> tuple[list[str], bool]:
    """env.split_module_flag: (argv, module) from `[--ckptsup-module] SCRIPT ARGS`."""
    if args and args[0] == RANK_MODULE_FLAG:
        return args[1:], True
    return args, False


def cold(argv: list[str], module: bool) -> None:
    os.execv(sys.executable, cold_rank_argv(sys.executable, argv, module=module))


def main() -> int:
    args, module = split_module_flag(sys.argv[1:])
    path = os.path.join(os.environ.get(WARM_DIR, ""), f"warm-{os.environ.get('LOCAL_RANK', '0')}.sock")
    if not os.environ.get(WARM_DIR) or not os.path.exists(path + ".ready"):
        cold(args, module)
    rank_pid: list[int] = []
    early: list[int] = []   # signals that came before the rank's pid: forwarded once it is known
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(rank_pid[0], signum) if rank_pid else early.append(signum))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HELLO_TIMEOUT_S)
    try:
        sock.connect(path)
        request = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "module": module}).encode()
        sock.sendmsg([request + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        reader = sock.makefile("rb")
        hello = json.loads(reader.readline() or b"{}")
        pid = int(hello["pid"])
        sock.settimeout(None)   # from here on the connection lasts as long as the rank
    except (OSError, ValueError, KeyError):
        _kill_peer(sock)   # a late wake-up must not run the rank a second time
        sock.close()
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        if early:
            os.kill(os.getpid(), early[0])   # stopped before the rank ran: as a cold rank would have been
        cold(args, module)   # the warm interpreter is gone, busy, stopped or stuck: start cold, lose nothing
    rank_pid.append(pid)
    for signum in early:
        _forward(pid, signum)
    rc = None
    for line in reader:
        try:
            rc = int(json.loads(line)["rc"])
        except (ValueError, KeyError, TypeError):
            continue
    # EOF: the rank's process is gone. Without an exit status it died of a signal: so do we
    if rc is None:
        os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(128 + signal.SIGKILL)   # not reached: SIGKILL is not caught
    return rc


def _kill_peer(sock: socket.socket) -> None:
    """SIGKILL the process at the other end (SO_PEERCRED: the kernel's word), if we reached one."""
    import struct

    try:
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        if pid > 0 and pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    except (OSError, struct.error):
        pass


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
