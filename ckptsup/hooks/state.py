"""What a checkpoint holds, and how it goes back (docs/training.md §What a checkpoint holds).

The DCP state dict has two parts:
- `model` and `optim`: from torch.distributed.checkpoint.state_dict.get_state_dict, so DDP, FSDP2
  and plain modules save the same keys and reshard on load;
- side state under `ckptsup/...` keys, each a fresh CPU tensor: global entries (step, scheduler,
  sampler position, user extras) written by rank 0 only, and per-rank entries (RNG, dataloader)
  under `ckptsup/rank<r>/...`. Everything non-tensor is JSON in a uint8 tensor (jsontensor.py).
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, ConfigError
from . import jsontensor
from .sampler import find_sampler

log = logging.getLogger("ckptsup.hooks")

PREFIX = "ckptsup/"
META_KEY = PREFIX + "meta"
SCHED_KEY = PREFIX + "lr_scheduler"
DATA_KEY = PREFIX + "data"
EXTRA_PREFIX = PREFIX + "extra/"
STATE_FORMAT = 1


def rank_key(rank: int, name: str) -> str:
    return f"{PREFIX}rank{rank}/{name}"


def check_dataloader(dataloader: Any, *, allow_stateless: bool) -> None:
    if dataloader is None or allow_stateless:
        return
    if not (callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))):
        raise ConfigError(
            f"dataloader {type(dataloader).__name__} has no state_dict/load_state_dict, so data would repeat "
            "after a restart; use torchdata.stateful_dataloader.StatefulDataLoader, or opt out with "
            "attach(allow_stateless_dataloader=True) / [checkpoint] allow_stateless_dataloader = true")
    if _creates_iterator_on_state_dict(dataloader):
        return
    try:
        dataloader.state_dict()   # once, now: a loader whose state_dict fails would fail the first save
    except Exception as err:  # noqa: BLE001 - whatever the loader raises, the answer is the same line
        what = f"{type(err).__name__}: {str(err)[:80]}".rstrip(": ")
        raise ConfigError(
            f"dataloader {type(dataloader).__name__}.state_dict() fails ({what}), so its position cannot be "
            "saved and data would repeat after a restart; with Accelerate pass "
            "DataLoaderConfiguration(use_stateful_dataloader=True) to the Accelerator, or use "
            "torchdata's StatefulDataLoader, or opt out with attach(allow_stateless_dataloader=True)") from None


def _creates_iterator_on_state_dict(dataloader: Any) -> bool:
    """torchdata's StatefulDataLoader: its state_dict() before the first iter() creates the
    iterator (workers and all) and its sampler pass, which a resume's load then has to undo; its
    state_dict is known to work, so it is not probed."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(dataloader, StatefulDataLoader)


def isolate_loader_rng(dataloader: Any) -> None:
    """A DataLoader without a generator draws its base seed from the global torch RNG every time
    an iterator is created; a resumed run creates one more iterator than the uninterrupted run
    did at that point, which shifts the global stream (dropout, ...) and breaks bit-exact resume.
    Give such a loader its own generator, seeded from the script's seed."""
    if dataloader is None or getattr(dataloader, "generator", False) is not None:
        return
    import torch

    dataloader.generator = torch.Generator().manual_seed(torch.initial_seed())
    log.info("ckptsup: gave the dataloader its own torch.Generator so creating an iterator does not "
             "consume the global RNG (pass generator= yourself to choose it)")


def _state_of(obj: Any) -> Any:
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        return obj.state_dict()
    if isinstance(obj, dict):
        return obj
    raise ConfigError(f"extra value of type {type(obj).__name__} is neither a dict nor has state_dict(); "
                      "pass a dict or an object with state_dict/load_state_dict")


def _load_into(obj: Any, state: Any, name: str) -> None:
    if hasattr(obj, "load_state_dict") and callable(obj.load_state_dict):
        obj.load_state_dict(state)
    elif isinstance(obj, dict):
        obj.clear()
        obj.update(state)
    else:
        raise ConfigError(f"extra {name!r} cannot be restored: it has no load_state_dict and is not a dict")


# ---- RNG ----------------------------------------------------------------------------------------

def capture_rng() -> tuple[dict[str, Any], Any]:
    """(JSON-able python+numpy state, torch CPU state tensor). CUDA states go in the JSON as
    tensors (one per device)."""
    import torch

    state: dict[str, Any] = {"python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state(legacy=True)
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state, torch.get_rng_state().clone()


def restore_rng(state: dict[str, Any], torch_state: Any) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(torch_state.clone())
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            log.warning("checkpoint has %d CUDA RNG states, this rank sees %d devices: CUDA RNG re-seeded",
                        len(saved), torch.cuda.device_count())


def derive_rng(*, step: int, rank: int, base: int = 0) -> int:
    """Deterministic per-rank seed after a world-size change (the old per-rank streams cannot be
    mapped onto new ranks)."""
    import torch

    digest = hashlib.sha256(f"ckptsup-rng/{base}/{step}/{rank}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (1 << 32))
    except ImportError:
        pass
    torch.manual_seed(seed)
    return seed


# ---- capture / restore --------------------------------------------------------------------------

@dataclass(kw_only=True)
class TrainingState:
    model: Any
    optimizer: Any = None
    lr_scheduler: Any = None
    dataloader: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1

    # model + optimizer through DCP's helpers (DDP, FSDP2, plain modules)
    def model_optim_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def side_state(self, *, step: int, meta: dict[str, Any], with_globals: bool = False) -> dict[str, Any]:
        """Fresh CPU tensors (never aliased to live training state). The global entries come from
        rank 0 only, or from every rank with `with_globals` (a memory bundle restores its rank alone)."""
        out: dict[str, Any] = {}
        if self.rank == 0 or with_globals:
            out[META_KEY] = jsontensor.to_tensor({"format": STATE_FORMAT, "step": step,
                                                  "world_size": self.world_size, **meta})
            if self.lr_scheduler is not None:
                out[SCHED_KEY] = jsontensor.to_tensor(self.lr_scheduler.state_dict())
            sampler = find_sampler(self.dataloader)
            if sampler is not None:
                out[DATA_KEY] = jsontensor.to_tensor(sampler.state_dict())
            for name, obj in self.extra.items():
                out[EXTRA_PREFIX + name] = jsontensor.to_tensor(_state_of(obj))
        rng_json, torch_rng = capture_rng()
        out[rank_key(self.rank, "rng")] = jsontensor.to_tensor(rng_json)
        out[rank_key(self.rank, "torch_rng")] = torch_rng
        if self.dataloader is not None and hasattr(self.dataloader, "state_dict"):
            out[rank_key(self.rank, "dataloader")] = jsontensor.to_tensor(self.dataloader.state_dict())
        return out

    # ---- load side ---------------------------------------------------------------------------
    def load_targets(self, metadata: Any) -> dict[str, Any]:
        """The state dict to hand to dcp.load: live model/optim state plus uint8 buffers sized from
        the (already verified) checkpoint metadata for every side entry this rank needs."""
        import torch

        targets = self.model_optim_state()
        available = metadata.state_dict_metadata
        if "optim" in targets and not any(k.startswith("optim.") for k in available):
            raise CheckpointError("checkpoint holds no optimizer state; attach the optimizer it was saved "
                                  "without, or start fresh")
        for key in self.side_keys(available):
            md = available[key]
            targets[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        return targets

    def side_keys(self, available: Any) -> list[str]:
        wanted = [META_KEY, SCHED_KEY, DATA_KEY, rank_key(self.rank, "rng"), rank_key(self.rank, "torch_rng"),
                  rank_key(self.rank, "dataloader")]
        wanted += [EXTRA_PREFIX + name for name in self.extra]
        return [k for k in wanted if k in available]

    def apply(self, loaded: dict[str, Any]) -> dict[str, Any]:
        """Put loaded state back into the live objects. Returns the checkpoint's meta."""
        from torch.distributed.checkpoint.state_dict import set_state_dict, set_model_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, loaded["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optim"])
        meta = jsontensor.from_tensor(loaded[META_KEY]) if META_KEY in loaded else {}
        if self.lr_scheduler is not None:
            if SCHED_KEY not in loaded:
                raise CheckpointError("checkpoint holds no LR scheduler state; it was saved without one")
            self.lr_scheduler.load_state_dict(jsontensor.from_tensor(loaded[SCHED_KEY]))
        for name, obj in self.extra.items():
            key = EXTRA_PREFIX + name
            if key not in loaded:
                if getattr(obj, "optional_extra", False):
                    continue   # added to the checkpoint later than this one was written
                raise CheckpointError(f"checkpoint holds no extra {name!r}; it was saved without it")
            _load_into(obj, jsontensor.from_tensor(loaded[key]), name)
        saved_world = int(meta.get("world_size", self.world_size))
        same_world = saved_world == self.world_size
        self._apply_data(loaded, same_world=same_world)
        rng_key = rank_key(self.rank, "rng")
        if same_world and rng_key in loaded:
            restore_rng(jsontensor.from_tensor(loaded[rng_key]), loaded[rank_key(self.rank, "torch_rng")])
        else:
            derive_rng(step=int(meta.get("step", 0)), rank=self.rank)
            if self.rank == 0:
                log.warning("world size changed from %d to %d: per-rank RNG re-derived from (step, rank)",
                            saved_world, self.world_size)
        meta["same_world"] = same_world
        meta["saved_world_size"] = saved_world
        return meta

    def _apply_data(self, loaded: dict[str, Any], *, same_world: bool) -> None:
        if self.dataloader is None:
            return
        loader_key = rank_key(self.rank, "dataloader")
        if same_world and loader_key in loaded and hasattr(self.dataloader, "load_state_dict"):
            self.dataloader.load_state_dict(jsontensor.from_tensor(loaded[loader_key]))
            return
        sampler = find_sampler(self.dataloader)
        if DATA_KEY in loaded and sampler is not None:
            # elastic: the global sample index is the source of truth
            sampler.load_state_dict(jsontensor.from_tensor(loaded[DATA_KEY]))
            return
        if not same_world:
            raise CheckpointError(
                "the world size changed and the dataloader has no ResumableDistributedSampler, so its position "
                "cannot be remapped; use ckptsup.hooks.sampler.ResumableDistributedSampler or the same world size")
