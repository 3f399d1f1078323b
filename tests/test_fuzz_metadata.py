"""Fuzz tier: DCP's `.metadata` through the reader's restricted unpickler
(ckptsup/hooks/reader.py `load_metadata_bytes`), the only place ckptsup unpickles anything (after
the manifest vouched for the bytes).

Allowed exception: ValidationError, one short line (a validation failure of that checkpoint: the
resume falls back to an older one). Nothing else escapes, whatever the bytes: garbage, pickles of
any object, real metadata with fields of the wrong type, damaged real metadata, globals of any
module and name, lengths past the end of the data. No module is imported and no thread started
by a refused pickle. Real metadata (DCP's dataclasses, every pickle protocol) round-trips."""

from __future__ import annotations

import pickle
import struct
import sys
import threading
from pathlib import PosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,  # noqa: E402
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ckptsup.errors import ValidationError  # noqa: E402
from ckptsup.hooks.reader import load_metadata_bytes  # noqa: E402
from fuzz_helpers import ANY_CHAR, assert_one_line, json_values, scalars, strings  # noqa: E402

pytestmark = pytest.mark.torch

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn]
fqns = st.text(ANY_CHAR, max_size=12)
sizes = st.lists(st.integers(0, 2 ** 40), max_size=3).map(torch.Size)


@st.composite
def tensor_entries(draw: st.DrawFn) -> TensorStorageMetadata:
    size = draw(sizes)
    dims = len(size)
    chunk = st.builds(ChunkStorageMetadata, offsets=st.lists(st.integers(0, 2 ** 40), min_size=dims,
                                                             max_size=dims).map(torch.Size),
                      sizes=st.lists(st.integers(0, 2 ** 40), min_size=dims, max_size=dims).map(torch.Size))
    props = st.builds(TensorProperties, dtype=st.sampled_from(DTYPES), layout=st.just(torch.strided),
                      requires_grad=st.booleans(), memory_format=st.sampled_from([torch.contiguous_format,
                                                                                  torch.channels_last]),
                      pin_memory=st.booleans())
    return TensorStorageMetadata(properties=draw(props), size=size, chunks=draw(st.lists(chunk, max_size=3)))


def metadatas() -> st.SearchStrategy[Metadata]:
    index = st.builds(MetadataIndex, fqn=fqns, offset=st.one_of(st.none(), sizes),
                      index=st.one_of(st.none(), st.integers(0, 100)))
    info = st.builds(_StorageInfo, relative_path=st.text(ANY_CHAR, max_size=12), offset=st.integers(0, 2 ** 63),
                     length=st.integers(0, 2 ** 63))
    meta = st.one_of(st.none(), st.builds(StorageMeta, checkpoint_id=st.one_of(st.none(), st.text(max_size=10),
                                                                               st.text(max_size=10).map(PosixPath)),
                                          save_id=st.one_of(st.none(), st.text(max_size=8))))
    return st.builds(Metadata, state_dict_metadata=st.dictionaries(fqns, st.one_of(tensor_entries(),
                                                                                   st.builds(BytesStorageMetadata)),
                                                                   max_size=4),
                     storage_data=st.dictionaries(index, info, max_size=4), storage_meta=meta,
                     version=st.one_of(st.none(), st.sampled_from(["1.0.0", "2.13"])))


WRONG = st.one_of(scalars(), json_values(max_leaves=4), st.builds(torch.Size, st.lists(st.integers(0, 5), max_size=2)),
                  st.sampled_from([torch.float32, torch.strided, PosixPath("/x"), BytesStorageMetadata(), (1, 2),
                                   frozenset({1}), b"bytes", 3j, ChunkStorageMetadata(torch.Size([1]), torch.Size([1])),
                                   ...]))


@st.composite
def damaged_metadata(draw: st.DrawFn) -> Metadata:
    """Real metadata with one attribute somewhere set to a value of the wrong type (unpickling sets
    attributes without any constructor, so a file can hold exactly this)."""
    m = draw(metadatas())
    targets = [m]
    for entry in m.state_dict_metadata.values():
        targets.append(entry)
        if isinstance(entry, TensorStorageMetadata):
            targets += [entry.properties, *entry.chunks]
    targets += [*m.storage_data, *m.storage_data.values()]
    if m.storage_meta is not None:
        targets.append(m.storage_meta)
    target = draw(st.sampled_from(targets))
    names = sorted(vars(target)) or ["anything"]
    name = draw(st.one_of(st.sampled_from(names), st.text(max_size=5)))
    try:
        object.__setattr__(target, name, draw(WRONG))
    except (AttributeError, TypeError):
        pass
    if draw(st.booleans()) and type(m.state_dict_metadata) is dict:   # or a dict of the wrong key or value type
        m.state_dict_metadata[draw(st.sampled_from([1, None, (1,)]))] = draw(WRONG)
    return m


def dumps(value: object, protocol: int) -> bytes:
    try:
        return pickle.dumps(value, protocol=protocol)
    except (TypeError, ValueError, AttributeError, RuntimeError, pickle.PicklingError, RecursionError):
        return pickle.dumps(None, protocol=protocol)   # a value pickle cannot write: not a file anyone has


protocols = st.integers(0, pickle.HIGHEST_PROTOCOL)
# DCP writes `.metadata` with pickle's default protocol (4); protocols 0 and 1 rebuild objects through
# copyreg._reconstructor, which is not allow-listed (no real file holds it): refused, not a round trip.
real_protocols = st.integers(2, pickle.HIGHEST_PROTOCOL)


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode("utf-8", "surrogatepass") + b"\n" + name.encode("utf-8", "surrogatepass") + b"\n"


MODULES = ["os", "builtins", "subprocess", "torch", "torch.distributed.checkpoint.staging",
           "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.metadata", "pathlib",
           "collections", "torch.serialization", "numpy", "ckptsup.no_such_module", "importlib", "sys", "shutil"]
NAMES = ["system", "eval", "exec", "getattr", "__import__", "load", "_ReplicationStager", "FileSystemWriter", "Metadata",
         "TensorStorageMetadata", "Metadata.__init__", "Size", "float32", "_get_layout", "OrderedDict", "PosixPath",
         "rmtree", "modules", "tensor", "Tensor", "storage", "_rebuild_tensor_v2", "import_module"]


@st.composite
def crafted_pickles(draw: st.DrawFn) -> bytes:
    """Pickles that name a global (any module, any name) and call it with junk, or that claim a
    length far past the end of the data."""
    choice = draw(st.integers(0, 3))
    if choice == 0:
        module = draw(st.one_of(st.sampled_from(MODULES), st.text(ANY_CHAR, max_size=10)))
        name = draw(st.one_of(st.sampled_from(NAMES), st.text(ANY_CHAR, max_size=10)))
        args = b"".join(pickle.dumps(a, protocol=0)[:-1] for a in draw(st.lists(st.one_of(
            st.none(), st.integers(), st.text(max_size=10), st.sampled_from(["/tmp/made-by-a-pickle", "1+1"])),
            max_size=3)))
        return _global(module.replace("\n", ""), name.replace("\n", "")) + b"(" + args + b"tR."
    if choice == 1:   # a counted opcode whose length is past anything the data holds
        opcode, fmt = draw(st.sampled_from([(b"\x8e", "<Q"), (b"\x8d", "<Q"), (b"\x96", "<Q"), (b"B", "<I"),
                                            (b"X", "<I"), (b"\x8b", "<i"), (b"\x95", "<Q")]))
        limit = 2 ** 63 - 1 if fmt.endswith("Q") else 2 ** 31 - 1
        length = draw(st.one_of(st.integers(1, limit), st.sampled_from([limit, 2 ** 40, 2 ** 33, 2 ** 31 - 1])))
        return b"\x80\x04" + opcode + struct.pack(fmt, min(length, limit)) + draw(st.binary(max_size=8))
    if choice == 2:
        return draw(st.binary(max_size=300))
    data = bytearray(dumps(draw(metadatas()), draw(protocols)))   # real metadata, damaged at a few bytes
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.integers(0, 3))
        if how == 0:
            data[at] = draw(st.integers(0, 255))
        elif how == 1:
            del data[at:]
        elif how == 2:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at:at + draw(st.integers(1, 8))]
    return bytes(data)


def _warm_up() -> None:
    """Import once what a good load needs, so a refused pickle is seen importing nothing."""
    load_metadata_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={},
                                              storage_meta=StorageMeta(checkpoint_id=PosixPath("/x")))))


_warm_up()


def check(data: bytes) -> object | None:
    modules, threads = set(sys.modules), threading.active_count()
    try:
        value = load_metadata_bytes(data)
    except ValidationError as err:
        assert_one_line(err)
        value = None
    else:
        assert type(value) is Metadata
    assert set(sys.modules) == modules, sorted(set(sys.modules) - modules)
    assert threading.active_count() == threads
    return value


@given(metadatas(), real_protocols)
def test_real_metadata_round_trips_at_every_protocol_from_2(metadata: Metadata, protocol: int) -> None:
    assert check(pickle.dumps(metadata, protocol=protocol)) == metadata


@given(damaged_metadata(), protocols)
def test_metadata_with_a_field_of_the_wrong_type_is_metadata_or_one_line(metadata: Metadata, protocol: int) -> None:
    check(dumps(metadata, protocol))


@given(st.one_of(json_values(), strings(), WRONG, st.lists(WRONG, max_size=3)), protocols)
def test_a_pickle_of_anything_else_is_one_line(value: object, protocol: int) -> None:
    assert check(dumps(value, protocol)) is None


@given(crafted_pickles())
def test_crafted_and_damaged_pickles_are_one_line_with_no_side_effect(data: bytes) -> None:
    check(data)


def test_a_length_past_the_end_of_the_data_is_a_validation_failure_not_a_memory_error() -> None:
    """Regression (found by this tier): a 12-byte `.metadata` claiming a 2**40-byte bytes object
    made the C unpickler allocate it first: MemoryError escaped, which is no checkpoint failure, so
    the resume crashed instead of falling back to an older checkpoint."""
    for opcode in (b"\x8e", b"\x8d", b"\x96"):   # BINBYTES8, BINUNICODE8, BYTEARRAY8
        with pytest.raises(ValidationError) as err:
            load_metadata_bytes(b"\x80\x04" + opcode + struct.pack("<Q", 2 ** 40) + b"x")
        assert "could not be read safely" in assert_one_line(err.value)
