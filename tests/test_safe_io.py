"""The one bounded reader of every file boundary: FIFOs, devices, directories, symlinks, huge
files, surrogate names, deep nesting and NaN are one-line errors, never a hang or a traceback."""

import os
import re

import pytest

from ckptsup.errors import ConfigError
from ckptsup.safe_io import json_depth_ok, loads_json, read_json, read_regular


def test_a_regular_file_is_read(tmp_path):
    (tmp_path / "a.json").write_text('{"x": [1, 2]}')
    assert read_json(tmp_path / "a.json", max_bytes=100, what="state", error=ConfigError) == {"x": [1, 2]}


def test_a_missing_file_passes_through_as_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "nope", max_bytes=10, what="state", error=ConfigError)


@pytest.mark.parametrize("make, needle", [
    (lambda p: os.mkfifo(p), "is a FIFO"),
    (lambda p: os.mkdir(p), "is a directory"),
    (lambda p: os.symlink("/dev/zero", p), "is a character device"),
])
def test_anything_but_a_regular_file_is_refused_without_blocking(tmp_path, make, needle):
    path = tmp_path / "x"
    make(path)
    with pytest.raises(ConfigError, match=needle):
        read_regular(path, max_bytes=10, what="site config", error=ConfigError)


def test_a_symlink_is_refused_where_links_are_not_followed(tmp_path):
    (tmp_path / "real").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="is a symlink"):
        read_regular(tmp_path / "link", max_bytes=10, what="manifest", error=ConfigError, follow_symlinks=False)
    assert read_regular(tmp_path / "link", max_bytes=10, what="config", error=ConfigError) == b"{}"


def test_a_file_over_the_cap_is_refused(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(ConfigError, match="101 bytes; at most 100"):
        read_regular(tmp_path / "big", max_bytes=100, what="state", error=ConfigError)


def test_a_lone_surrogate_name_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="cannot be encoded"):
        read_regular(str(tmp_path / "bad\ud800"), max_bytes=10, what="manifest", error=ConfigError)


def test_deep_nesting_is_refused_before_the_parser_recurses():
    deep = "[" * 100_000 + "]" * 100_000
    assert not json_depth_ok(deep) and json_depth_ok('["[[[[" ]')
    with pytest.raises(ConfigError, match="nests deeper"):
        loads_json(deep, what="frame", error=ConfigError)
    brackets_in_a_string = '{"a": "' + "[" * 100 + '"}'
    assert loads_json(brackets_in_a_string, what="frame", error=ConfigError) == {"a": "[" * 100}


def test_nan_and_infinity_are_refused_unless_allowed():
    with pytest.raises(ConfigError, match="not valid JSON"):
        loads_json('{"x": NaN}', what="state", error=ConfigError)
    assert loads_json('{"x": Infinity}', what="events", error=ConfigError, allow_nonfinite=True)["x"] == float("inf")


def test_garbage_is_one_error(tmp_path):
    with pytest.raises(ConfigError, match="not valid JSON"):
        loads_json(b"\xff\xfe{", what="state", error=ConfigError)


def test_a_file_you_may_not_read_is_named_with_the_fix(tmp_path):
    """Run as the job's user would be: as root, in a forked child that became `nobody`."""
    path = tmp_path / "site.toml"
    path.write_text("[x]\n")
    path.chmod(0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                read_regular(path, max_bytes=10, what="site config", error=ConfigError)
                message = "read it"
            except ConfigError as err:
                message = str(err)
            os.write(write, message.encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    assert re.search(r"is not readable by you .*fix its permissions", message), message
