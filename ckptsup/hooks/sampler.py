"""ResumableDistributedSampler: the data position is one global sample index.

Every epoch is one permutation of the dataset (seeded by `seed + epoch`, identical on every rank).
The position is the number of samples of that permutation consumed by all ranks together. Rank r
of W takes `perm[start + i*W + r]` for i = 0, 1, ... so a resume at another world size W' simply
continues from the same global index with the new stride: no sample repeats and none is skipped
(except, like `drop_last`, the < W' samples at the tail of an epoch that cannot be shared evenly,
which keeps every rank's batch count equal so DDP never waits on a rank with one batch less).

Exact with `num_workers=0` (the sampler is pulled exactly as batches are consumed). With worker
processes the loader prefetches indices; at the same world size torchdata's StatefulDataLoader
state accounts for that, while an elastic resume uses this index (see docs/training.md §Resuming).
"""

from __future__ import annotations

from typing import Any, Iterator

STATE_VERSION = 1


class ResumableDistributedSampler:
    """A drop-in for torch.utils.data.distributed.DistributedSampler with a resumable, world-size
    independent position. `set_epoch` is optional: after a full pass the next `iter()` starts the
    next epoch by itself."""

    def __init__(self, dataset: Any, *, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0) -> None:
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
            num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if initialized else 1)
            rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0        # global index where the current pass began
        self.yielded = 0      # indices this rank yielded in the current pass
        self._pending: tuple[int, int] | None = None  # (epoch, start) for the next iter()

    # ---- position ------------------------------------------------------------------------------
    @property
    def dataset_len(self) -> int:
        return len(self.dataset)

    @property
    def global_index(self) -> int:
        """Samples of this epoch's permutation consumed by all ranks together."""
        return self.start + self.yielded * self.num_replicas

    def per_rank_remaining(self, start: int) -> int:
        return max(0, (self.dataset_len - start) // self.num_replicas)

    def __len__(self) -> int:
        start = self._pending[1] if self._pending is not None else self.start
        return self.per_rank_remaining(start)

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` at its beginning — except the epoch a resume just loaded: Lightning, the
        HF Trainer and Accelerate call set_epoch at every epoch start, the resumed one included,
        and resetting there would repeat the samples already trained on."""
        if self._pending is not None and self._pending[0] == epoch:
            return
        self._pending = (epoch, 0)

    def _permutation(self, epoch: int) -> list[int]:
        import torch

        if not self.shuffle:
            return list(range(self.dataset_len))
        gen = torch.Generator()
        gen.manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_len, generator=gen).tolist()

    def __iter__(self) -> Iterator[int]:
        if self._pending is not None:
            self.epoch, self.start = self._pending
            self._pending = None
        elif self.yielded > 0 or self.start > 0:
            # the previous pass ran (fully or not): a new iter() starts the next epoch
            self.epoch, self.start = self.epoch + 1, 0
        if self.per_rank_remaining(self.start) == 0 and self.start > 0:
            self.epoch, self.start = self.epoch + 1, 0
        self.yielded = 0
        return self._generate(self.epoch, self.start)

    def _generate(self, epoch: int, start: int) -> Iterator[int]:
        perm = self._permutation(epoch)
        count = self.per_rank_remaining(start)
        for i in range(count):
            self.yielded += 1
            yield perm[start + i * self.num_replicas + self.rank]

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """World-size independent: the same on every rank of a data-parallel group."""
        epoch, index = (self._pending if self._pending is not None else (self.epoch, self.global_index))
        return {"version": STATE_VERSION, "epoch": epoch, "global_index": index,
                "seed": self.seed, "shuffle": self.shuffle, "dataset_len": self.dataset_len,
                "world_size": self.num_replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("epoch", "global_index", "seed", "dataset_len"):
            if key not in state:
                raise ValueError(f"sampler state lacks {key!r}; it was not written by ResumableDistributedSampler")
        if state["dataset_len"] != self.dataset_len or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for a dataset of {state['dataset_len']} samples with seed {state['seed']}, "
                f"this one has {self.dataset_len} and seed {self.seed}; resume with the same dataset and seed")
        epoch, index = int(state["epoch"]), int(state["global_index"])
        if index >= self.dataset_len:
            epoch, index = epoch + 1, 0
        self._pending = (epoch, index)
        self.epoch, self.start, self.yielded = epoch, index, 0


def find_sampler(dataloader: Any) -> ResumableDistributedSampler | None:
    """The ResumableDistributedSampler that feeds `dataloader`, if any."""
    for owner in (dataloader, getattr(dataloader, "batch_sampler", None)):
        sampler = getattr(owner, "sampler", None)
        if isinstance(sampler, ResumableDistributedSampler):
            return sampler
    return None
