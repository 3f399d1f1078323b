"""The data position of a Lightning train DataLoader (docs/integrations.md §Lightning).

A plain `DataLoader` has no position to save. Lightning gives it a `DistributedSampler`
(`use_distributed_sampler=True`, the default) or keeps the user's sampler. Once the loader exists
(`on_train_start`), the sampler inside its `batch_sampler` is replaced by a `LoaderSampler`, a
`ResumableDistributedSampler` that yields the same indices in the same order:

- `DistributedSampler` (exact type): same num_replicas, rank, shuffle, seed (one `randperm` seeded
  `seed + epoch`, the same rank interleave), if its length matches (the dataset divides evenly, or
  drop_last): a padded sampler repeats samples, ours drops the tail, and Lightning has already
  counted the batches;
- `RandomSampler` (no replacement, no num_samples): one replica, shuffled, seeded from
  `PL_GLOBAL_SEED` (a new but deterministic order: RandomSampler's own cannot be resumed);
- `SequentialSampler`: one replica, in order;
- a `ResumableDistributedSampler` of the user's: the same parameters.

Anything else is left alone with one warning: its data position is not restored.

The position saved is Lightning's count of batches of the epoch x batch size x replicas, not the
sampler's own count, which runs ahead by the prefetched batches when the loader has workers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ..hooks.sampler import ResumableDistributedSampler

log = logging.getLogger("ckptsup.integrations.lightning")


class LoaderSampler(ResumableDistributedSampler):
    """A ResumableDistributedSampler whose length is the whole epoch's, also right after a
    mid-epoch load: Lightning counts an epoch's batches from len(loader) and continues its own
    batch counter from the checkpoint, so a length of the remaining part would end it early."""

    def __len__(self) -> int:
        return self.per_rank_remaining(0)


@dataclass(frozen=True)
class SamplerPlan:
    """How to replace a loader's sampler: the LoaderSampler's parameters, or why it cannot."""

    num_replicas: int = 1
    rank: int = 0
    shuffle: bool = False
    seed: int = 0
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


def global_seed() -> int:
    """Lightning's own default seed for the samplers it creates (`seed_everything` sets it)."""
    try:
        return int(os.environ.get("PL_GLOBAL_SEED", "0"))
    except ValueError:
        return 0


def plan_sampler(sampler: Any, *, dataset_len: int | None) -> SamplerPlan:
    """Pure: which LoaderSampler reproduces `sampler`'s order, or the reason none does."""
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    name = type(sampler).__name__
    if dataset_len is None:
        return SamplerPlan(reason="its dataset has no length")
    if isinstance(sampler, ResumableDistributedSampler):
        return SamplerPlan(num_replicas=sampler.num_replicas, rank=sampler.rank, shuffle=sampler.shuffle,
                           seed=sampler.seed)
    if type(sampler) is DistributedSampler:
        if not sampler.drop_last and dataset_len % sampler.num_replicas:
            return SamplerPlan(reason=f"its DistributedSampler pads {dataset_len} samples to a multiple of "
                                      f"{sampler.num_replicas} ranks (repeating some); use a dataset whose length "
                                      "divides by the world size, or DistributedSampler(drop_last=True)")
        return SamplerPlan(num_replicas=sampler.num_replicas, rank=sampler.rank, shuffle=sampler.shuffle,
                           seed=sampler.seed)
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            return SamplerPlan(reason="its RandomSampler draws with replacement or a num_samples of its own")
        return SamplerPlan(shuffle=True, seed=global_seed())
    if type(sampler) is SequentialSampler:
        return SamplerPlan()
    return SamplerPlan(reason=f"its sampler {name} is not one ckptsup knows how to resume (DistributedSampler, "
                              "RandomSampler, SequentialSampler, ResumableDistributedSampler)")


def plan_loader(loader: Any) -> SamplerPlan:
    """Pure: the plan for one train loader (a torch DataLoader with a batch sampler)."""
    from torch.utils.data import BatchSampler, DataLoader

    if not isinstance(loader, DataLoader):
        return SamplerPlan(reason=f"it is a {type(loader).__name__}, not a torch DataLoader")
    if callable(getattr(loader, "state_dict", None)):
        return SamplerPlan(reason="it has a state_dict of its own (Lightning's loop state carries it)")
    if type(loader.batch_sampler) is not BatchSampler:
        return SamplerPlan(reason="it has no plain BatchSampler (batch_size=None, or a batch_sampler of the user's)")
    try:
        dataset_len = len(loader.dataset)   # type: ignore[arg-type]  # a Dataset may be Sized; TypeError if not
    except TypeError:
        dataset_len = None
    return plan_sampler(loader.batch_sampler.sampler, dataset_len=dataset_len)


def install_sampler(loader: Any, plan: SamplerPlan) -> LoaderSampler:
    """Put a LoaderSampler into the loader's batch sampler. The loader's iterator may already exist
    (Lightning creates it in setup_data), but a BatchSampler only reads its sampler at the first
    batch; with worker processes the caller re-creates the iterator."""
    sampler = LoaderSampler(loader.dataset, num_replicas=plan.num_replicas, rank=plan.rank, shuffle=plan.shuffle,
                            seed=plan.seed)
    loader.batch_sampler.sampler = sampler
    # DataLoader refuses a new `sampler` after init; keep loader.sampler the one in use for readers
    object.__setattr__(loader, "sampler", sampler)
    return sampler


class DataPosition:
    """The train loaders' positions as a checkpoint extra (state_dict/load_state_dict). A loaded
    position waits until the loaders exist (`apply`)."""

    def __init__(self) -> None:
        self.samplers: list[LoaderSampler | None] = []
        self.batch_sizes: list[int] = []
        self.batches_done = lambda: 0     # Lightning's batches of the current epoch, set by the callback
        self.pending: list[dict[str, Any] | None] | None = None

    def track(self, samplers: list[LoaderSampler | None], batch_sizes: list[int]) -> None:
        self.samplers, self.batch_sizes = samplers, batch_sizes

    def state_dict(self) -> dict[str, Any]:
        if not self.samplers and self.pending is not None:
            return {"loaders": self.pending}   # saved before the loaders exist: what was loaded
        return {"loaders": [None if s is None else position(s, self.batches_done(), b)
                            for s, b in zip(self.samplers, self.batch_sizes)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = list(state.get("loaders") or [])

    def apply(self) -> bool:
        """Give each tracked sampler its loaded position. False when nothing was loaded."""
        if self.pending is None:
            return False
        if len(self.pending) != len(self.samplers):
            log.warning("ckptsup: the checkpoint has data positions for %d train loader(s), this run has %d: "
                        "the data restarts at the epoch's start", len(self.pending), len(self.samplers))
        for sampler, state in zip(self.samplers, self.pending):
            if sampler is not None and state is not None:
                sampler.load_state_dict(state)
        self.pending = None
        return True


def position(sampler: ResumableDistributedSampler, batches_done: int, batch_size: int) -> dict[str, Any]:
    """The sampler's state with its global index taken from the batches Lightning has trained on in
    this epoch (exact with prefetching workers, which pull the sampler ahead)."""
    state = sampler.state_dict()
    state["global_index"] = min(sampler.dataset_len, batches_done * batch_size * sampler.num_replicas)
    return state
