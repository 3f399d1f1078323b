"""How a rank opens its channel to the agent (hooks/agent_socket.py RankChannel): the files the
supervisor's environment names — CKPTSUP_SECRET_FILE and CKPTSUP_RANK_SOCKET — missing, empty,
stale or of the wrong kind are one ckptsup ConfigError line at attach(), naming the variable and
the fix, never a raw FileNotFoundError / ConnectionRefusedError traceback and never a channel
keyed with an empty secret."""

from __future__ import annotations

import os
import secrets
import socket
import threading
from pathlib import Path

import pytest

from ckptsup.errors import CkptsupError, ConfigError
from ckptsup.hooks.agent_socket import RankChannel


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)
    return path


@pytest.fixture
def listening(tmp_path: Path):
    """A socket where the agent would listen, accepting (and holding) connections."""
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir(mode=0o700)
    path = sock_dir / "ranks.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conns.append(server.accept()[0])
            except OSError:
                return
    threading.Thread(target=accept, daemon=True).start()
    yield path
    server.close()
    for conn in conns:
        conn.close()


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, CkptsupError)
    return message


def test_a_good_secret_and_socket_connect(secret_file: Path, listening: Path) -> None:
    channel = RankChannel(socket_path=str(listening), secret_file=str(secret_file), rank=0)
    assert channel.connected
    channel.close()


def test_a_missing_socket_is_one_line_naming_the_variable(secret_file: Path, tmp_path: Path) -> None:
    missing = tmp_path / "gone" / "ranks.sock"
    with pytest.raises(ConfigError) as err:
        RankChannel(socket_path=str(missing), secret_file=str(secret_file), rank=0)
    message = one_line(err)
    assert f"CKPTSUP_RANK_SOCKET {missing} does not exist" in message and "ckptsup launch" in message


def test_a_socket_nobody_listens_on_is_one_line(secret_file: Path, tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(stale))
    server.close()  # the agent died; its socket file stays
    with pytest.raises(ConfigError) as err:
        RankChannel(socket_path=str(stale), secret_file=str(secret_file), rank=0)
    assert "nobody listens" in one_line(err)


def test_a_regular_file_as_the_socket_is_one_line(secret_file: Path, tmp_path: Path) -> None:
    plain = tmp_path / "not-a-socket"
    plain.write_text("x")
    with pytest.raises(ConfigError) as err:
        RankChannel(socket_path=str(plain), secret_file=str(secret_file), rank=0)
    assert "CKPTSUP_RANK_SOCKET" in one_line(err)


def test_a_socket_path_too_long_for_unix_sockets_is_one_line(secret_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        RankChannel(socket_path="/tmp/" + "x" * 200, secret_file=str(secret_file), rank=0)
    assert "CKPTSUP_RANK_SOCKET" in one_line(err)


def test_a_missing_secret_file_is_one_line_naming_the_variable(tmp_path: Path, listening: Path) -> None:
    with pytest.raises(ConfigError) as err:
        RankChannel(socket_path=str(listening), secret_file=str(tmp_path / "nope"), rank=0)
    message = one_line(err)
    assert "(CKPTSUP_SECRET_FILE)" in message and "does not exist" in message


@pytest.mark.parametrize("content", [b"", b"short", b"z" * 64])
def test_an_empty_or_short_secret_is_refused_not_used_as_the_key(tmp_path: Path, listening: Path,
                                                                 content: bytes) -> None:
    path = tmp_path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(ConfigError) as err:
        RankChannel(socket_path=str(listening), secret_file=str(path), rank=0)
    assert "at least 64 hex characters" in one_line(err)


def test_a_socket_without_a_secret_is_refused(listening: Path) -> None:
    """Under a supervisor both come together; frames keyed with b'' would be dropped as forged."""
    with pytest.raises(ConfigError) as err:
        RankChannel(socket_path=str(listening), secret_file=None, rank=0)
    message = one_line(err)
    assert "CKPTSUP_RANK_SOCKET is set but CKPTSUP_SECRET_FILE is not" in message


def test_without_a_socket_the_channel_stays_a_no_op(tmp_path: Path) -> None:
    channel = RankChannel(socket_path=None, secret_file=None, rank=0)
    assert not channel.connected


@pytest.mark.torch
def test_attach_under_a_vanished_agent_is_one_ckptsup_error(tmp_path: Path, monkeypatch, secret_file: Path) -> None:
    torch = pytest.importorskip("torch")
    import ckptsup

    for name in [n for n in os.environ if n.startswith("CKPTSUP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CKPTSUP_RANK_SOCKET", str(tmp_path / "gone.sock"))
    monkeypatch.setenv("CKPTSUP_SECRET_FILE", str(secret_file))
    monkeypatch.setenv("CKPTSUP_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        ckptsup.attach(model=torch.nn.Linear(2, 2))
    assert "CKPTSUP_RANK_SOCKET" in one_line(err) and "does not exist" in str(err.value)
