"""ResumableDistributedSampler: the global sample index survives any change of world size."""

from __future__ import annotations

import random

import pytest

from ckptsup.hooks.sampler import ResumableDistributedSampler

pytestmark = pytest.mark.torch

N = 48


def take(samplers: list[ResumableDistributedSampler], per_rank: int) -> list[int]:
    """Draw `per_rank` indices from every rank, interleaved in global order (rank r of W takes
    position g + i*W + r)."""
    iters = [iter(s) for s in samplers]
    out = []
    for _ in range(per_rank):
        out.extend(next(it) for it in iters)
    return out


def group(world: int, state: dict | None = None) -> list[ResumableDistributedSampler]:
    samplers = [ResumableDistributedSampler(list(range(N)), num_replicas=world, rank=r, seed=7) for r in range(world)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    return samplers


def test_ranks_partition_an_epoch_without_overlap() -> None:
    samplers = group(4)
    seen = [list(s) for s in samplers]
    flat = [i for rank in seen for i in rank]
    assert sorted(flat) == list(range(N))
    assert all(len(rank) == N // 4 for rank in seen)


def test_a_new_iter_after_a_full_pass_starts_the_next_epoch_with_another_order() -> None:
    (s,) = group(1)
    first, second = list(s), list(s)
    assert sorted(first) == sorted(second) == list(range(N))
    assert first != second
    assert s.state_dict()["epoch"] == 1


@pytest.mark.parametrize("seed", range(5))
def test_changing_world_size_mid_epoch_neither_repeats_nor_skips(seed: int) -> None:
    rng = random.Random(seed)
    reference = take(group(1), N)            # the epoch's global order
    consumed: list[int] = []
    world, state = 2, None
    while len(consumed) < N:
        samplers = group(world, state)
        remaining_per_rank = (N - len(consumed)) // world
        if remaining_per_rank == 0:
            break
        k = rng.randint(1, remaining_per_rank)
        consumed += take(samplers, k)
        states = [s.state_dict() for s in samplers]
        assert all(st == states[0] for st in states), "the position must be the same on every rank"
        state = states[0]
        assert state["global_index"] == len(consumed)
        world = rng.choice([1, 2, 3, 4])
    assert consumed == reference[:len(consumed)]
    assert len(set(consumed)) == len(consumed)
    assert N - len(consumed) < 4  # at most the < W tail that cannot be shared evenly


def test_loading_a_state_of_another_dataset_or_seed_is_refused() -> None:
    (s,) = group(1)
    state = s.state_dict()
    other = ResumableDistributedSampler(list(range(N + 1)), num_replicas=1, rank=0, seed=7)
    with pytest.raises(ValueError, match="dataset of 48 samples"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        s.load_state_dict({"epoch": 0})


def test_a_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        ResumableDistributedSampler(list(range(N)), num_replicas=2, rank=2)


def test_set_epoch_of_the_resumed_epoch_keeps_the_loaded_position_as_frameworks_call_it() -> None:
    """Lightning, the HF Trainer and Accelerate call set_epoch(e) at every epoch start, the resumed
    one included: the sequence after a resume must equal the uninterrupted run's."""
    (whole,) = group(1)
    whole.set_epoch(0)
    uninterrupted = list(whole)
    whole.set_epoch(1)
    uninterrupted += list(whole)
    (before,) = group(1)
    before.set_epoch(0)
    it = iter(before)
    seen = [next(it) for _ in range(15)]
    (after,) = group(1, before.state_dict())
    after.set_epoch(0)           # the framework's call at the resumed epoch's start
    seen += list(after)
    after.set_epoch(1)           # the next epoch starts at its beginning
    seen += list(after)
    assert seen == uninterrupted   # no sample repeated, none skipped


def test_set_epoch_to_another_epoch_than_the_loaded_one_starts_that_epoch() -> None:
    (s,) = group(1)
    it = iter(s)
    [next(it) for _ in range(5)]
    (resumed,) = group(1, s.state_dict())
    resumed.set_epoch(3)
    assert resumed.state_dict()["epoch"] == 3 and resumed.state_dict()["global_index"] == 0
