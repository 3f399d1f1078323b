"""Fuzz tier: checkpoint records and directories — the manifest (`Manifest.from_json`,
`load_manifest`, `check_relpath`), validation records (`read_validation`), `validate`, the catalog
(`inspect_step`, `list_checkpoints`, `latest_*`), the trust check (`check_dir_trusted`) and the
supervisor's resume choice over all of them (`pick_resume`).

Allowed exceptions: ManifestError from Manifest.from_json / load_manifest / check_relpath;
TrustError (OwnerModeError included) from check_dir_trusted; none from read_validation (None:
"not validated"), validate (a ValidationResult), inspect_step of a step_<N> directory,
list_checkpoints and the latest_* lookups (hostile checkpoints are INCOMPLETE or REJECTED), and
none from pick_resume over a directory whose older checkpoint is good. Every message and every
recorded problem is one short line. Promises checked over any mix of hostile changes to the
newest checkpoint: a hostile record (validation.json) is not a bad checkpoint; a trust problem
(mode, owner) quarantines nothing; the older good checkpoint is never touched; what is
quarantined is moved, never deleted. A manifest round-trips through to_json → from_json."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import stat
import tempfile
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptsup.checkpoint.catalog import (Status, inspect_step, latest_committed, latest_durable, latest_validated,
                                        list_checkpoints)
from ckptsup.checkpoint.hashing import HASH_ALGORITHMS
from ckptsup.checkpoint.manifest import (MAX_INT, MAX_STEP, RESERVED_NAMES, FileEntry, ItemEntry, Manifest,
                                         check_relpath, load_manifest)
from ckptsup.checkpoint.synthetic import write_synthetic
from ckptsup.checkpoint.trust import OwnerModeError, check_dir_trusted
from ckptsup.checkpoint.validate import QUARANTINE_DIR, read_validation, validate
from ckptsup.errors import ManifestError, TrustError
from ckptsup.supervisor.job.recovery import pick_resume
from fuzz_helpers import (FILE_KINDS, assert_one_line, finite_json, fresh_dir, json_bytes, json_values,
                          mutated, plain_text, plant, scalars, strings, write_private)

# ---- valid manifests -------------------------------------------------------------------------

name_part = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="/\\\x00"), min_size=1,
                    max_size=12).filter(lambda p: p not in (".", ".."))
relpaths = st.lists(name_part, min_size=1, max_size=3).map("/".join).filter(
    lambda p: len(p.encode()) <= 1024 and not (len(p) > 1 and p[1] == ":") and p not in RESERVED_NAMES)
hashes = st.builds(lambda alg, digest: f"{alg}:{digest}", st.sampled_from(HASH_ALGORITHMS),
                   st.text("0123456789abcdef", min_size=1, max_size=128))
plain = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
free_form = st.dictionaries(plain, finite_json(max_leaves=6, surrogates=False), max_size=3)
offsets = st.one_of(st.integers(0, 4096), st.integers(0, MAX_INT))
zones = st.sampled_from([None, timezone.utc, timezone(timedelta(hours=-5)), timezone(timedelta(hours=13, minutes=45))])
created = st.builds(lambda when, tz: when.replace(tzinfo=tz).isoformat(),
                    st.datetimes(datetime(2, 1, 1), datetime(9998, 12, 31)), zones)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    paths = draw(st.lists(relpaths, max_size=4, unique=True))
    files = [FileEntry(path=p, size=draw(offsets), hash=draw(hashes)) for p in paths]
    items = [ItemEntry(key=draw(plain), file=draw(st.sampled_from(paths)) if paths else draw(relpaths),
                       offset=draw(offsets), length=draw(offsets), hash=draw(hashes))
             for _ in range(draw(st.integers(0, 4)))]
    metadata_file = draw(st.one_of(st.just(""), relpaths))
    return Manifest(step=draw(st.integers(0, MAX_STEP)), checkpoint_id=str(draw(st.uuids())), job_id=draw(plain),
                    attempt=draw(offsets), epoch=draw(offsets), world_size=draw(st.integers(1, MAX_INT)),
                    mesh=draw(free_form), files=files, items=items, metadata_file=metadata_file,
                    metadata_hash=draw(hashes) if metadata_file else draw(st.one_of(st.just(""), hashes)),
                    hash_algorithm=draw(st.sampled_from(HASH_ALGORITHMS)), versions=draw(free_form),
                    created_at=draw(created), extra=draw(free_form))


def manifest_values() -> st.SearchStrategy[object]:
    """A manifest's JSON value with fields (and fields of its entries) replaced by anything."""
    entry_values = st.one_of(json_values(max_leaves=4), strings(), scalars())

    def damage(m: Manifest) -> st.SearchStrategy[object]:
        data = json.loads(m.to_json())
        file0 = data["files"][0] if data["files"] else {"path": "a", "size": 1, "hash": "crc32:00"}
        item0 = data["items"][0] if data["items"] else {"key": "k", "file": "a", "offset": 0, "length": 1,
                                                        "hash": "crc32:00"}
        return st.one_of(
            mutated(data, field_values=st.one_of(entry_values, st.sampled_from(
                [10 ** 400, -1, MAX_STEP + 1, "0001-01-01T00:00:00+01:00", "9999-12-31T23:00:00-05:00",
                 "not-a-uuid", "\u0661" * 32, "xxh3-128:XYZ", "md5:00", "../x", "/etc/passwd", "a\\b",
                 "a//b", "manifest.json", "\ud800", 2]))),
            st.builds(lambda f: {**data, "files": [f, *data["files"][1:]]}, mutated(file0, field_values=entry_values)),
            st.builds(lambda i: {**data, "items": [i, *data["items"][1:]]}, mutated(item0, field_values=entry_values)),
            st.just({**data, "files": data["files"] + data["files"][:1]}),   # a path listed twice
        )
    return st.one_of(manifests().flatmap(damage), json_values())


@given(manifests())
def test_a_manifest_round_trips(manifest: Manifest) -> None:
    text = manifest.to_json()
    assert Manifest.from_json(text) == manifest
    assert Manifest.from_json(text.encode()) == manifest


@given(json_bytes(manifest_values()), st.booleans())
def test_a_manifest_of_anything_is_a_manifest_or_one_line(data: bytes, as_text: bool) -> None:
    try:
        manifest = Manifest.from_json(data.decode("utf-8", "surrogateescape") if as_text else data)
    except ManifestError as err:
        assert_one_line(err)
    else:   # what was accepted can name files: every path encodes, stays inside, sizes are real
        for entry in manifest.files:
            assert check_relpath(entry.path, what="file", source="x") == entry.path and 0 <= entry.size <= MAX_INT
        manifest.created_datetime   # noqa: B018  (a comparable UTC datetime, never a ValueError)


@given(strings())
def test_check_relpath_accepts_only_names_inside_the_step_dir(path: str) -> None:
    try:
        assert check_relpath(path, what="files[0]", source="m") == path
    except ManifestError as err:
        assert_one_line(err)
    else:
        encoded = os.fsencode(path)
        assert not path.startswith("/") and ".." not in path.split("/") and b"\x00" not in encoded
        assert os.path.normpath(os.path.join("/step", path)).startswith("/step/")


@given(json_bytes(manifest_values()), st.sampled_from(FILE_KINDS), st.booleans())
def test_load_manifest_of_anything_in_a_step_dir_is_a_manifest_or_one_line(data: bytes, kind: str,
                                                                           step_is_link: bool) -> None:
    with fresh_dir() as d:
        real = d / "real_step_1"
        real.mkdir(mode=0o700)
        plant(real / "manifest.json", kind, data)
        step = d / "step_1"
        if step_is_link:
            step.symlink_to(real)
        else:
            real.rename(step)
        try:
            load_manifest(step)
        except ManifestError as err:
            assert_one_line(err)


# ---- validation records ----------------------------------------------------------------------

RECORD = {"ok": True, "level": 2, "requested": 2, "problems": [], "checkpoint_id": str(uuid.UUID(int=1)),
          "duration_s": 0.1, "ts": "2026-01-01T00:00:00+00:00"}


def record_bytes() -> st.SearchStrategy[bytes]:
    return json_bytes(st.one_of(mutated(RECORD), json_values()))


@given(record_bytes(), st.sampled_from(FILE_KINDS))
def test_a_validation_record_of_anything_is_a_record_or_not_validated(data: bytes, kind: str) -> None:
    with fresh_dir() as d:
        plant(d / "validation.json", kind, data)
        record = read_validation(d)
        if record is not None:   # what catalog, pick_resume and `ckpt list` act on has its types
            assert type(record["ok"]) is bool and type(record.get("level", 0)) is int
            assert all(isinstance(p, str) for p in record.get("problems", []))


# ---- a checkpoint directory under attack -------------------------------------------------------

RECORD_OPS = ("validation",)
TRUST_OPS = ("mode", "owner")
CONTENT_OPS = ("manifest-bytes", "manifest-kind", "extra-file", "shard-bytes", "shard-kind", "hardlink", "subdir",
               "rename-step")
OPS = RECORD_OPS + TRUST_OPS + CONTENT_OPS


@st.composite
def attacks(draw: st.DrawFn) -> list[tuple[str, dict]]:
    """One to three hostile changes to a checkpoint directory, with their arguments."""
    out = []
    for op in draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=3)):
        if op == "validation":
            args = {"kind": draw(st.sampled_from(FILE_KINDS)), "data": draw(record_bytes())}
        elif op == "mode":
            args = {"target": draw(st.sampled_from(["dir", "manifest", "shard", "metadata"])),
                    "bits": draw(st.sampled_from([0o020, 0o002, 0o022, 0o777, 0o000]))}
        elif op == "owner":
            args = {"target": draw(st.sampled_from(["dir", "manifest", "shard"]))}
        elif op == "manifest-bytes":
            args = {"data": draw(json_bytes(manifest_values()))}
        elif op == "manifest-kind":
            args = {"kind": draw(st.sampled_from([k for k in FILE_KINDS if k != "regular"]))}
        elif op == "extra-file":
            args = {"name": draw(plain_text(min_size=1, max_size=20).filter(
                lambda n: "/" not in n and n not in (".", "..") and len(n.encode()) < 200))}
        elif op == "shard-bytes":
            args = {"how": draw(st.sampled_from(["truncate", "append", "flip"])), "at": draw(st.integers(0, 127))}
        elif op == "shard-kind":
            args = {"kind": draw(st.sampled_from(["fifo", "directory", "dev-zero", "symlink-to-regular",
                                                  "dangling-symlink", "missing"]))}
        elif op == "rename-step":
            args = {"name": draw(st.sampled_from(["step_0002", "step_" + "9" * 18, "step_" + "9" * 19, "mine",
                                                  "step_2\udcff", "step_-2", ".tmp-step_2", "step_1x"]))}
        else:
            args = {}
        out.append((op, args))
    return out


def apply_attack(step: Path, op: str, args: dict) -> Path:
    """Apply one change; returns where the step dir now is."""
    shard = step / "__0_0.distcp"
    target = {"dir": step, "manifest": step / "manifest.json", "shard": shard,
              "metadata": step / ".metadata"}.get(args.get("target", ""), step)
    if op == "validation":   # a link's target outside the checkpoint: only the record changes
        _remove(step / "validation.json")
        plant(step / "validation.json", args["kind"], args["data"], real_dir=step.parent.parent)
    elif op == "mode" and os.path.lexists(target) and not os.path.islink(target):
        os.chmod(target, stat.S_IMODE(os.lstat(target).st_mode) | args["bits"] if args["bits"] else 0o000)
    elif op == "owner" and os.path.lexists(target) and not os.path.islink(target):
        os.chown(target, 65534, 65534)
    elif op == "manifest-bytes":
        _remove(step / "manifest.json")
        write_private(step / "manifest.json", args["data"])
    elif op == "manifest-kind":
        _remove(step / "manifest.json")
        plant(step / "manifest.json", args["kind"], b"{}")
    elif op == "extra-file":
        path = os.path.join(os.fsencode(step), os.fsencode(args["name"]))
        if not os.path.lexists(path):
            write_private(Path(os.fsdecode(path)), b"x")
    elif op == "shard-bytes" and shard.is_file() and not shard.is_symlink():
        data = bytearray(shard.read_bytes())
        if args["how"] == "truncate":
            data = data[:args["at"] % max(len(data), 1)]
        elif args["how"] == "append":
            data += b"\0"
        elif data:
            data[args["at"] % len(data)] ^= 0xFF
        write_private(shard, bytes(data))
    elif op == "shard-kind":
        _remove(shard)
        plant(shard, args["kind"], b"y" * 64)
    elif op == "hardlink" and shard.is_file() and not shard.is_symlink() and not os.path.lexists(step.parent / "elsewhere"):
        os.link(shard, step.parent / "elsewhere")
    elif op == "subdir" and not os.path.lexists(step / "sub"):
        (step / "sub").mkdir(mode=0o700)
        write_private(step / "sub" / "f", b"z")
    elif op == "rename-step":
        new = step.with_name(args["name"])
        if not os.path.lexists(new):
            os.rename(step, new)
            return new
    return step


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for p in sorted(path.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        path.rmdir()
    elif os.path.lexists(path):
        path.unlink()


@functools.cache
def two_checkpoints() -> Path:
    """A checkpoint_dir of two good synthetic checkpoints (step_1, step_2), written once through
    the real commit path; each example works on a copy."""
    ckdir = Path(tempfile.mkdtemp(prefix="ckptsup-fuzz-template-")) / "ck"
    atexit.register(shutil.rmtree, ckdir.parent, ignore_errors=True)
    now = datetime.now(timezone.utc)
    write_synthetic(ckdir, step=1, ranks=2, items_per_rank=2, item_bytes=64, created_at=now - timedelta(hours=1))
    write_synthetic(ckdir, step=2, ranks=2, items_per_rank=2, item_bytes=64, created_at=now)
    return ckdir


def tree(path: Path) -> dict[str, bytes]:
    """The content of a checkpoint: its files but the records (validation.json, written by validating it)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != "validation.json"}


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(attacks())
def test_a_checkpoint_dir_under_attack_never_crashes_a_reader_nor_loses_the_good_checkpoint(
        ops: list[tuple[str, dict]]) -> None:
    with fresh_dir() as d:
        ckdir = d / "ck"
        shutil.copytree(two_checkpoints(), ckdir, symlinks=True)   # modes kept: 0700 dirs, 0600 files
        newest = ckdir / "step_2"
        older = tree(ckdir / "step_1")
        for op, args in ops:
            newest = apply_attack(newest, op, args)
        kinds = {op for op, _ in ops}

        # the readers, one by one
        for info in list_checkpoints(ckdir, include_quarantined=True):
            if info.problem:
                assert_one_line(info.problem)
        try:
            check_dir_trusted(newest, recursive=True, skip={"validation.json"})
        except TrustError as err:
            assert_one_line(err)
            assert not isinstance(err, OwnerModeError) or kinds & set(TRUST_OPS), err
        result = validate(newest, level=2, record=False)
        for problem in result.problems:
            assert_one_line(problem)
        assert result.ok == (not result.problems)
        if kinds <= set(RECORD_OPS):   # a bad record is no bad checkpoint
            assert result.ok, result.problems
        if result.untrusted:
            assert kinds & set(TRUST_OPS), result.problems
        if newest.name.startswith("step_") and newest.name[5:].isdigit() and len(newest.name) <= 23:
            info = inspect_step(newest)
            assert info.status in Status and (not info.problem or assert_one_line(info.problem))
        latest_committed(ckdir)
        latest_validated(ckdir)
        latest_durable(ckdir)

        # the supervisor's choice: the newest when its content is intact, else the older one
        events, warnings = [], []
        chosen = pick_resume(ckdir, lambda name, **fields: events.append((name, fields)), warn=warnings.append)
        assert chosen in (str(ckdir / "step_1"), str(newest)), chosen
        if kinds <= set(RECORD_OPS):
            assert chosen == str(newest)
        for line in warnings + [f["reason"] for _, f in events if "reason" in f]:
            assert_one_line(line)
        assert tree(ckdir / "step_1") == older   # never touched, never quarantined
        quarantined = sorted(os.listdir(ckdir / QUARANTINE_DIR)) if (ckdir / QUARANTINE_DIR).is_dir() else []
        if not kinds & set(CONTENT_OPS):
            assert not quarantined, (ops, quarantined)   # trust and records never quarantine
        if quarantined:   # moved, not deleted: the whole directory is there
            assert not os.path.lexists(newest) and len(quarantined) == 1


# ---- regressions the fuzz tier found -----------------------------------------------------------

def test_a_file_name_with_a_line_break_in_a_checkpoint_is_reported_on_one_line() -> None:
    """A stray file called "x\\ny" (or "\\x85") in a step dir made a two-line validation problem:
    a forged second line in `ckpt verify`'s output, the supervisor's warning and the event's reason."""
    with fresh_dir() as d:
        ckdir = d / "ck"
        shutil.copytree(two_checkpoints(), ckdir, symlinks=True)
        for name in ("x\ny", "\x85", "ckptsup: error: \u2028forged"):
            write_private(ckdir / "step_2" / name, b"x")
        result = validate(ckdir / "step_2", level=2, record=False)
        assert not result.ok and len(result.problems) == 3
        assert {assert_one_line(p) for p in result.problems} == {
            "x\\ny: present but not listed in the manifest", "\\x85: present but not listed in the manifest",
            "ckptsup: error: \\u2028forged: present but not listed in the manifest"}


def test_every_ckptsup_error_is_one_line_whatever_it_quotes() -> None:
    from ckptsup.errors import ConfigError

    assert str(ConfigError("/tmp/a\nb does not exist")) == "/tmp/a\\nb does not exist"
    assert str(ConfigError("crlf\r\n, vt\x0b, ff\x0c, fs\x1c, nel\x85, ls\u2028, ps\u2029")) == \
        "crlf\\r\\n, vt\\x0b, ff\\x0c, fs\\x1c, nel\\x85, ls\\u2028, ps\\u2029"


def test_unknown_manifest_fields_and_huge_numbers_are_named_short_on_one_line() -> None:
    data = json.loads(Manifest(step=1, metadata_file="").to_json())
    for change, shown in (({"line\nbreak": 1}, "unknown manifest field(s) 'line\\nbreak'"),
                          ({"k" * 100_000: 1}, "unknown manifest field(s) 'kkkk"),
                          ({f"x{i}": 1 for i in range(1000)}, "(+997 more)"),
                          ({"step": -(10 ** 4000)}, "got a 4001-digit negative number"),
                          ({"format_version": 10 ** 4000}, "format_version a 4001-digit number is not supported"),
                          ({"hash_algorithm": "h" * 100_000}, "hash_algorithm 'hhhh")):
        try:
            Manifest.from_json(json.dumps({**data, **change}))
        except ManifestError as err:
            assert shown in assert_one_line(err), str(err)[:300]
        else:
            raise AssertionError(change)


# ---- the trust check over any tree ------------------------------------------------------------

ENTRY_KINDS = ("file", "file", "dir", "symlink", "fifo", "hardlink", "group-writable", "world-writable", "foreign",
               "unreadable")


@given(st.lists(st.tuples(st.sampled_from(ENTRY_KINDS), st.integers(0, 3)), max_size=6), st.booleans(),
       st.sampled_from([0o700, 0o750, 0o770, 0o707, 0o500]))
def test_check_dir_trusted_of_any_tree_is_the_path_or_one_trust_error(entries: list[tuple[str, int]], recursive: bool,
                                                                      top_mode: int) -> None:
    with fresh_dir() as d:
        top = d / "step_1"
        top.mkdir(mode=0o700)
        dirs, direct = [top], set()
        for i, (kind, parent) in enumerate(entries):
            where = dirs[parent % len(dirs)] / f"e{i}"
            if where.parent == top:
                direct.add(kind)
            if kind == "dir":
                where.mkdir(mode=0o700)
                dirs.append(where)
            elif kind == "symlink":
                where.symlink_to("/etc/passwd")
            elif kind == "fifo":
                os.mkfifo(where, 0o600)
            elif kind == "hardlink":
                write_private(d / f"outside{i}", b"x")
                os.link(d / f"outside{i}", where)
            else:
                write_private(where, b"x")
                if kind == "group-writable":
                    os.chmod(where, 0o620)
                elif kind == "world-writable":
                    os.chmod(where, 0o602)
                elif kind == "foreign":
                    os.chown(where, 65534, 65534)
                elif kind == "unreadable":
                    os.chmod(where, 0o000)
        os.chmod(top, top_mode)
        kinds = {kind for kind, _ in entries}
        try:
            assert check_dir_trusted(top, recursive=recursive) == top
        except OwnerModeError as err:   # owner, mode, permissions: never a reason to quarantine
            assert_one_line(err)
            assert top_mode & 0o022 or (recursive and kinds & {"group-writable", "world-writable", "foreign",
                                                              "unreadable"}), err
        except TrustError as err:       # what it holds: symlinks, special files, hard links
            assert_one_line(err)
            assert kinds & {"symlink", "fifo", "hardlink"}, err
        else:
            hostile = {"symlink", "fifo", "hardlink", "group-writable", "world-writable", "foreign"}
            assert not top_mode & 0o022 and "symlink" not in direct and not (recursive and kinds & hostile)
            if os.geteuid() != 0:
                assert not (recursive and "unreadable" in kinds) and top_mode & 0o500 == 0o500
