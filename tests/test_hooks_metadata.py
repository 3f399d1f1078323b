"""DCP's `.metadata` is a pickle. The reader's unpickler admits exactly the globals real metadata
holds (recorded here from real files: DCP's FileSystemWriter and ckptsup's own writer, a model, an
optimizer, a torchtitan-like nested state and a DTensor), and the result must be DCP's Metadata of
the expected shape. Anything else is a validation failure of that checkpoint: it is quarantined
and the resume falls back to the older one, with no side effect and no crash."""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from dcp_helpers import build_state
from hooks_helpers import attach_parts, fast_site_config, make_parts, private_dir, train_steps

from ckptsup.checkpoint.hashing import hash_bytes
from ckptsup.errors import ValidationError
from ckptsup.hooks import reader
from ckptsup.hooks.reader import ALLOWED_GLOBALS, VerifyingReader, load_metadata_bytes, safe_load_planner

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parent.parent
# allow-listed although no file written here names them (kept for metadata written elsewhere:
# a planner that puts an OrderedDict in planner_data, a PurePosixPath checkpoint_id)
NOT_SEEN_HERE = {("collections", "OrderedDict"), ("pathlib", "PurePosixPath")}


@pytest.fixture(autouse=True)
def fast_housekeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTSUP_SITE_CONFIG", fast_site_config())


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = private_dir(tmp_path_factory.mktemp("dcp"))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "dcp_helpers.py"), str(out)], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, str]]:
    """Every global the reader's unpickler is asked for while the test runs."""
    seen: set[tuple[str, str]] = set()
    original = reader._MetadataUnpickler.find_class

    def find_class(self, module: str, name: str):
        seen.add((module, name))
        return original(self, module, name)

    monkeypatch.setattr(reader._MetadataUnpickler, "find_class", find_class)
    return seen


def _dtype_like(pair: tuple[str, str]) -> bool:
    module, name = pair
    value = getattr(torch, name, None) if module == "torch" else None
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


def test_real_dcp_metadata_needs_exactly_the_allow_list(written: Path, recorded: set) -> None:
    for path in (written / "plain" / ".metadata", written / "ck" / "step_7" / ".metadata"):
        metadata = load_metadata_bytes(path.read_bytes())
        assert type(metadata).__name__ == "Metadata" and metadata.state_dict_metadata
    named = {pair for pair in recorded if not _dtype_like(pair)}
    assert named <= ALLOWED_GLOBALS
    assert ALLOWED_GLOBALS - named == NOT_SEEN_HERE, "an allow-listed global no real file needs: drop it"
    assert {name for module, name in recorded if _dtype_like((module, name))} >= {"float32", "bfloat16", "int64", "int8", "bool"}


def test_a_dcp_checkpoint_of_model_optimizer_and_nested_state_loads_through_the_reader(written: Path) -> None:
    """Our reader loads exactly what DCP's own reader loads from the same state (its values were
    computed in the writing process, so DCP's plain reader is the reference)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    ours, reference = build_state(seed=1), build_state(seed=1)   # other values, same structure
    before = _flatten(build_state(seed=1))
    storage = VerifyingReader(written / "ck" / "step_7")
    assert storage.read_metadata() is storage.read_metadata()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(ours, storage_reader=storage, planner=safe_load_planner(), no_dist=True)
        dcp.load(reference, storage_reader=FileSystemReader(written / "plain"), no_dist=True)
    flat_ours, flat_reference = _flatten(ours), _flatten(reference)
    assert flat_ours.keys() == flat_reference.keys() == _flatten(build_state()).keys()
    changed = 0
    for key, value in flat_reference.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(flat_ours[key], value) and flat_ours[key].dtype == value.dtype, key
            changed += not torch.equal(before[key], value) if before[key].numel() else 0
        else:
            assert flat_ours[key] == value, key
    assert changed >= 10 and storage.bytes_read > 0
    assert _flatten(ours)["train_state.ntokens_seen"] == 123456 and _flatten(ours)["train_state.tag"] == "run-a"


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, list) and any(isinstance(v, dict) for v in tree):
        out = {}
        for i, value in enumerate(tree):
            out.update(_flatten(value, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): tree}


def test_a_checkpoint_of_ckptsups_own_writer_needs_only_the_allow_list(tmp_path: Path, recorded: set) -> None:
    ck = _two_checkpoints(tmp_path)
    step, _ = _resume(ck)
    assert step == 4
    assert {pair for pair in recorded if not _dtype_like(pair)} <= ALLOWED_GLOBALS - NOT_SEEN_HERE


# ---- crafted metadata ----------------------------------------------------------------------------

def _call(module: str, name: str, *args: object) -> bytes:
    """A protocol-0 pickle calling module.name(*args): what a crafted .metadata can ask for."""
    body = b"".join(b"N" if a is None else pickle.dumps(a, protocol=0)[:-1] for a in args)
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n(" + body + b"tR."


def test_dcp_classes_with_side_effects_are_refused_before_they_run(tmp_path: Path) -> None:
    made = tmp_path / "made-by-a-pickle"
    threads = threading.active_count()
    crafted = [
        _call("torch.distributed.checkpoint.staging", "_ReplicationStager", None, None, None, str(made)),  # makedirs
        _call("torch.distributed.checkpoint.staging", "DefaultStager"),                                   # a thread pool
        _call("torch.distributed.checkpoint.filesystem", "FileSystemWriter", str(made)),
        _call("torch.distributed.checkpoint.filesystem", "FileSystemReader", str(made)),
        _call("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
        _call("builtins", "eval", "1+1"),
        _call("torch", "load", str(made)),
    ]
    for data in crafted:
        with pytest.raises(ValidationError, match="not allowed in DCP metadata"):
            load_metadata_bytes(data)
    assert not made.exists() and threading.active_count() == threads


@pytest.mark.parametrize("payload", [
    pytest.param(lambda: {"state_dict_metadata": {}}, id="a-dict"),
    pytest.param(lambda: torch.Size([3]), id="torch-size"),
    pytest.param(lambda: collections.OrderedDict(a=1), id="ordered-dict"),
    pytest.param(lambda: _metadata(storage_data=None), id="metadata-without-storage-data"),
    pytest.param(lambda: _metadata(state_dict_metadata={"w": "not a tensor description"}), id="metadata-bad-entry"),
])
def test_an_unpickled_object_that_is_not_dcp_metadata_is_a_validation_failure(payload) -> None:
    with pytest.raises(ValidationError, match="not DCP's checkpoint metadata"):
        load_metadata_bytes(pickle.dumps(payload()))


def _metadata(**fields):
    from torch.distributed.checkpoint.metadata import Metadata

    base = {"state_dict_metadata": {}, "storage_data": {}}
    base.update(fields)
    return Metadata(**base)


# ---- through a real resume: refused, nothing happens, the older checkpoint is used ----------------

def _two_checkpoints(base: Path) -> Path:
    ck = private_dir(base) / "ck"
    parts = make_parts()
    run = attach_parts(parts, ck, save_every_steps=2, async_save=False)
    assert run.resume() == 0
    train_steps(run, *parts, 0, 4)
    run.close()
    return ck


def _resume(ck: Path):
    parts = make_parts(seed=99)
    run = attach_parts(parts, ck, save_every_steps=2, async_save=False)
    try:
        return run.resume(), parts[0]
    finally:
        run.close(final_save=False)


def _vouch_for(step_dir: Path, metadata: bytes) -> None:
    """Replace .metadata and make the manifest vouch for it (size and hashes): the content is
    hostile, the bookkeeping consistent, as a writer with access to the directory could make it."""
    (step_dir / ".metadata").write_bytes(metadata)
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    digest = hash_bytes(metadata, manifest["hash_algorithm"])
    for entry in manifest["files"]:
        if entry["path"] == ".metadata":
            entry.update(size=len(metadata), hash=digest)
    manifest["metadata_hash"] = digest
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("crafted", ["side-effect", "not-metadata", "metadata-without-storage-data"])
def test_a_crafted_metadata_is_quarantined_and_resume_falls_back_to_the_older_checkpoint(tmp_path: Path, crafted: str) -> None:
    ck = _two_checkpoints(tmp_path)
    made = tmp_path / "made-by-a-pickle"
    data = {
        "side-effect": _call("torch.distributed.checkpoint.staging", "_ReplicationStager", None, None, None, str(made)),
        "not-metadata": pickle.dumps({"storage_meta": None}),
        "metadata-without-storage-data": pickle.dumps(_metadata(storage_data=None)),
    }[crafted]
    _vouch_for(ck / "step_4", data)
    step, _ = _resume(ck)
    assert step == 2
    assert not made.exists()
    assert not (ck / "step_4").exists() and len(os.listdir(ck / "quarantine")) == 1
