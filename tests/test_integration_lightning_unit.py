"""The Lightning integration's pure parts: which sampler replaces which, the position saved, and
that LoaderSampler yields exactly DistributedSampler's indices (tests/test_integration_lightning.py
runs the real framework)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from ckptsup.hooks.sampler import ResumableDistributedSampler
from ckptsup.integrations import lightning_data as data
from ckptsup.integrations.lightning import CkptsupCallback, _loss_of


def dataset(n: int) -> list[int]:
    return list(range(n))


@pytest.mark.parametrize("n,shuffle,drop_last", [(96, True, False), (96, False, False), (97, True, True)])
def test_the_replacement_yields_distributed_samplers_order_on_every_rank(n, shuffle, drop_last):
    for epoch in (0, 3):
        for rank in (0, 1):
            theirs = DistributedSampler(dataset(n), num_replicas=2, rank=rank, shuffle=shuffle, seed=5,
                                        drop_last=drop_last)
            plan = data.plan_sampler(theirs, dataset_len=n)
            assert plan.ok
            ours = data.LoaderSampler(dataset(n), num_replicas=plan.num_replicas, rank=plan.rank,
                                      shuffle=plan.shuffle, seed=plan.seed)
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_the_plan_for_each_sampler(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "11")
    assert data.plan_sampler(RandomSampler(dataset(8)), dataset_len=8) == data.SamplerPlan(shuffle=True, seed=11)
    assert data.plan_sampler(SequentialSampler(dataset(8)), dataset_len=8) == data.SamplerPlan()
    own = ResumableDistributedSampler(dataset(8), num_replicas=4, rank=3, shuffle=False, seed=2)
    assert data.plan_sampler(own, dataset_len=8) == data.SamplerPlan(num_replicas=4, rank=3, seed=2)
    padded = data.plan_sampler(DistributedSampler(dataset(9), num_replicas=2, rank=0), dataset_len=9)
    assert not padded.ok and "divides by the world size" in padded.reason
    assert not data.plan_sampler(RandomSampler(dataset(8), replacement=True), dataset_len=8).ok
    assert "not one ckptsup knows" in data.plan_sampler(iter([1]), dataset_len=8).reason
    assert not data.plan_sampler(SequentialSampler(dataset(8)), dataset_len=None).ok


def test_the_plan_for_a_loader():
    assert data.plan_loader(DataLoader(dataset(8), batch_size=2)).ok
    assert "no plain BatchSampler" in data.plan_loader(DataLoader(dataset(8), batch_size=None)).reason
    custom = DataLoader(dataset(8), batch_sampler=[[0, 1], [2, 3]])
    assert not data.plan_loader(custom).ok
    assert "not a torch DataLoader" in data.plan_loader([1, 2]).reason


def test_installing_puts_the_sampler_in_the_batch_sampler_even_after_the_iterator_exists():
    loader = DataLoader(dataset(16), batch_size=4, shuffle=False)
    iterator = iter(loader)   # Lightning's setup_data creates it before on_train_start
    sampler = data.install_sampler(loader, data.plan_loader(loader))
    sampler.load_state_dict({"epoch": 0, "global_index": 8, "seed": 0, "dataset_len": 16})
    assert isinstance(loader.batch_sampler, BatchSampler) and loader.batch_sampler.sampler is sampler
    assert loader.sampler is sampler
    assert [b.tolist() for b in iterator] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert len(loader) == 4   # Lightning counts the whole epoch's batches, also after a mid-epoch load


def test_the_position_comes_from_lightnings_batch_count_and_waits_for_the_loaders():
    position = data.DataPosition()
    position.load_state_dict({"loaders": [{"epoch": 1, "global_index": 16, "seed": 0, "dataset_len": 32}]})
    assert position.state_dict()["loaders"][0]["global_index"] == 16   # saved before the loader exists
    sampler = data.LoaderSampler(dataset(32), num_replicas=2, rank=1, shuffle=True, seed=0)
    position.track([sampler], [2])
    assert position.apply() and not position.apply()
    sampler.set_epoch(1)   # Lightning calls it for the resumed epoch: the position stays
    first = next(iter(sampler))
    assert first == torch.randperm(32, generator=torch.Generator().manual_seed(1)).tolist()[16 + 1]
    position.batches_done = lambda: 7   # prefetching workers may have pulled more: Lightning's count wins
    assert position.state_dict()["loaders"][0] == {**sampler.state_dict(), "global_index": 28}
    position.batches_done = lambda: 100
    assert position.state_dict()["loaders"][0]["global_index"] == 32


def test_the_callback_takes_no_arguments_and_only_keyword_options():
    CkptsupCallback()
    assert CkptsupCallback(save_every_steps=3).attach_options["save_every_steps"] == 3
    with pytest.raises(TypeError):
        CkptsupCallback(3)   # noqa: the options are keyword-only


def test_the_loss_is_found_in_what_training_step_returned():
    loss = torch.tensor(0.5)
    assert _loss_of(loss) is loss and _loss_of({"loss": loss, "x": 1}) is loss
    assert _loss_of(None) is None and _loss_of({"x": 1}) is None
