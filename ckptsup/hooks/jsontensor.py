"""State that is not a model or optimizer tensor travels as JSON inside a uint8 tensor.

DCP would otherwise pickle such values (torch.save of a Python object); a pickle from disk is
code execution. Tagged JSON covers what dataloaders, schedulers and RNGs hold: dicts with any
scalar keys, lists, tuples, bytes, tensors and numpy arrays.
"""

from __future__ import annotations

import base64
import json
from typing import Any

_TAG = "__ckptsup__"


def _encode(obj: Any) -> Any:
    import torch

    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")):
            return {_TAG: "float", "v": repr(obj)}
        return obj
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {_TAG: "dict", "v": {k: _encode(v) for k, v in obj.items()}}
        return {_TAG: "kdict", "v": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "v": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, (bytes, bytearray)):
        return {_TAG: "bytes", "v": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        # reshape(-1): a 0-dim tensor (ModelCheckpoint's best_model_score) has no byte view of its own
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "v": base64.b64encode(raw).decode()}
    np = _numpy()
    if np is not None:
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            return {_TAG: "ndarray", "dtype": arr.dtype.str, "shape": list(arr.shape),
                    "v": base64.b64encode(arr.tobytes()).decode()}
        if isinstance(obj, np.generic):
            return _encode(obj.item())
    raise TypeError(f"cannot store {type(obj).__name__} without pickling; use tensors, numbers, strings, "
                    "lists and dicts in state_dict()")


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    value: Any = obj.get("v")   # its shape follows the tag
    if tag == "dict":
        return {k: _decode(v) for k, v in value.items()}
    if tag == "kdict":
        return {_decode(k): _decode(v) for k, v in value}
    if tag == "tuple":
        return tuple(_decode(v) for v in value)
    if tag == "float":
        return float(value)
    if tag == "bytes":
        return base64.b64decode(value)
    if tag == "tensor":
        import torch

        dtype = getattr(torch, obj["dtype"])
        raw = bytearray(base64.b64decode(value))
        if not raw:
            return torch.empty(obj["shape"], dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(obj["shape"]).clone()
    if tag == "ndarray":
        np = _numpy()
        return np.frombuffer(base64.b64decode(value), dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    raise ValueError(f"unknown tagged value {tag!r} in stored JSON state")


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def to_tensor(obj: Any):
    """Any JSON-able state → a 1-D uint8 tensor."""
    import torch

    data = json.dumps(_encode(obj), separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def from_tensor(tensor) -> Any:
    return _decode(json.loads(bytes(tensor.cpu().numpy().tobytes()).decode()))
