"""Replica fingerprints (hooks/fingerprint.py) and the manifest's replicas record
(checkpoint/validate.py), in-process on real tensors."""
import copy

import pytest
import torch

from ckptsup.checkpoint.manifest import Manifest
from ckptsup.checkpoint.validate import REPLICAS_KEY, replica_problem
from ckptsup.hooks.fingerprint import (ROW, Replication, fingerprint, flip_bit, grouped_verdict, record, replica_group,
                                      replication, state_tensors, verdict)

pytestmark = pytest.mark.torch


def fp(*tensors):
    return fingerprint([(str(i), t) for i, t in enumerate(tensors)])


def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.LayerNorm(30), torch.nn.Linear(30, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 40)).sum().backward()
    opt.step()
    return model, opt


def test_identical_state_gives_identical_fingerprints_and_one_flipped_bit_changes_them():
    model, opt = trained()
    twin, twin_opt = copy.deepcopy(model), torch.optim.AdamW(copy.deepcopy(model).parameters())
    twin_opt = torch.optim.AdamW(twin.parameters())
    twin_opt.load_state_dict(opt.state_dict())
    assert fingerprint(state_tensors(model, opt)) == fingerprint(state_tensors(twin, twin_opt))
    flip_bit(twin, param=2, index=7, bit=0)
    assert fingerprint(state_tensors(model, opt)) != fingerprint(state_tensors(twin, twin_opt))


def test_the_optimizer_state_counts():
    model, opt = trained()
    before = fingerprint(state_tensors(model, opt))
    with torch.no_grad():
        state = opt.state[next(iter(model.parameters()))]["exp_avg_sq"]
        state.view(-1).view(torch.int32)[0] ^= 1
    assert fingerprint(state_tensors(model, opt)) != before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 2 * ROW + 13])
def test_every_single_bit_flip_is_seen_whatever_the_dtype_and_size(dtype, n):
    t = (torch.arange(n) % 97).to(dtype)
    base = fp(t)
    raw = t.view(torch.uint8)
    for pos in sorted({0, raw.numel() // 2, raw.numel() - 1}):
        for bit in (0, 7):
            other = t.clone()
            other.view(torch.uint8)[pos] ^= 1 << bit
            assert fp(other) != base, (pos, bit)


def test_swapped_words_and_swapped_tensors_are_seen():
    t = torch.randn(3 * ROW + 5)
    swapped = t.clone()
    swapped[[1, ROW + 1]] = t[[ROW + 1, 1]]          # same column, other rows: the row lane
    assert fp(swapped) != fp(t)
    swapped = t.clone()
    swapped[[1, 2]] = t[[2, 1]]                      # same row: the column lane
    assert fp(swapped) != fp(t)
    a, b = torch.randn(10), torch.randn(10)
    assert fp(a, b) != fp(b, a)


def test_a_non_contiguous_or_offset_tensor_fingerprints_as_its_values():
    base = torch.randn(64, 33)
    assert fp(base.t()) == fp(base.t().contiguous())
    flat = torch.randn(101)
    assert fp(flat[1:]) == fp(flat[1:].clone())     # a storage offset not 8-aligned


def test_the_majority_names_the_odd_rank_and_two_copies_have_none():
    good, bad = (1, 2), (3, 4)
    v = verdict([good, bad, good])
    assert not v.agree and v.odd == (1,) and v.disputed == (1,) and v.majority
    v = verdict([good, bad])
    assert not v.agree and v.odd == () and v.disputed == (0, 1) and not v.majority
    v = verdict([good, bad, (5, 6)])
    assert not v.agree and not v.majority and v.disputed == (0, 1, 2)
    v = verdict([good, good, bad, bad])
    assert not v.majority                            # a tie is no majority
    assert verdict([good] * 4).agree and record(verdict([good] * 4)) == {"agree": True, "copies": 4,
                                                                         "fingerprint": verdict([good]).fingerprint}
    assert record(verdict([good, bad, good]))["disputed"] == [1]


def test_only_a_ddp_model_is_known_to_hold_replicas(tmp_path):
    """DDP keeps every rank's bytes equal: compared. DTensor shards differ by design, and a plain
    module may be a pipeline stage or a per-rank model: comparing those would be a false alarm."""
    import torch.distributed as dist

    model, _ = trained()
    assert replication(model) is Replication.UNKNOWN
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert replication(torch.nn.parallel.DistributedDataParallel(model)) is Replication.REPLICAS
    finally:
        dist.destroy_process_group()

    class Shard(torch.nn.Parameter):
        def to_local(self):
            return self

    model[0].weight = Shard(model[0].weight.data)
    assert replication(model) is Replication.SHARDS


def manifest(extra):
    return Manifest(step=30, job_id="1", attempt=0, epoch=1, world_size=3, created_at="2026-01-01T00:00:00+00:00",
                    files=[], items=[], hash_algorithm="xxh3-128", extra=extra)


def test_a_manifest_of_disagreeing_replicas_is_refused_and_one_without_the_record_is_not():
    bad = manifest({REPLICAS_KEY: record(verdict([(1,), (2,), (1,)]))})
    assert "replicas disagreed at step 30 (ranks 1 in dispute)" in replica_problem(bad)
    assert replica_problem(manifest({REPLICAS_KEY: record(verdict([(1,), (1,)]))})) is None
    assert replica_problem(manifest({})) is None


def test_hsdp_compares_each_shard_across_its_replica_groups():
    """grouped_verdict: the ranks with the same key hold the same shard. A 2x2 (replicate, shard)
    mesh with rank 3's copy flipped: shard 1's pair (ranks 1, 3) is in dispute with no majority,
    shard 0's pair (0, 2) is not; 3x2 names rank 3 alone; other shards are never compared."""
    shard0, shard1, bad = (1, 2), (3, 4), (5, 6)
    assert grouped_verdict([shard0, shard1, shard0, shard1], [0, 1, 0, 1]).agree
    v = grouped_verdict([shard0, shard1, shard0, bad], [0, 1, 0, 1])
    assert not v.agree and not v.majority and v.disputed == (1, 3) and v.copies == 2
    v = grouped_verdict([shard0, shard1, shard0, bad, shard0, shard1], [0, 1, 0, 1, 0, 1])
    assert not v.agree and v.majority and v.odd == v.disputed == (3,) and v.copies == 3 and v.fingerprint
    v = grouped_verdict([bad, shard1, shard0, bad, shard0, shard1], [0, 1, 0, 1, 0, 1])
    assert v.majority and v.odd == (0, 3)            # both groups outvote one rank each
    v = grouped_verdict([bad, shard1, shard0, bad], [0, 1, 0, 1])
    assert not v.majority and v.disputed == (0, 1, 2, 3)
    assert grouped_verdict([shard0, shard1, bad], [-1, -1, -1]).agree   # nobody has a replica
    assert grouped_verdict([shard0, bad], [0, 0]) == verdict([shard0, bad])   # one group of all: DDP's
    # the record of an agreeing HSDP state: the groups' majorities folded into one fingerprint
    same = grouped_verdict([shard0, shard1, shard0, shard1], [0, 1, 0, 1]).fingerprint
    assert same and same != grouped_verdict([shard0, bad, shard0, bad], [0, 1, 0, 1]).fingerprint


class Placement:
    def __init__(self, replicate: bool) -> None:
        self.replicate = replicate

    def is_replicate(self) -> bool:
        return self.replicate


class Mesh:
    def __init__(self, ranks: list[list[int]]) -> None:
        self.mesh = torch.tensor(ranks)


def test_the_replica_group_comes_from_the_parameters_mesh():
    """replica_group: the ranks whose coordinates differ only along the dimension every parameter
    is replicated on (a fake mesh: the real one runs in tests/test_sdc_hsdp.py)."""
    model, _ = trained()
    mesh = Mesh([[0, 1], [2, 3], [4, 5]])
    for p in model.parameters():
        p.device_mesh, p.placements, p.to_local = mesh, (Placement(True), Placement(False)), lambda: None
    assert replication(model) is Replication.HYBRID
    assert [replica_group(model, r) for r in range(6)] == [(0, 2, 4), (1, 3, 5)] * 3
    next(model.parameters()).placements = (Placement(False), Placement(False))   # one parameter sharded on both
    assert replication(model) is Replication.SHARDS and replica_group(model, 3) == (3,)
    flat = Mesh([[0, 1, 2, 3]])
    for p in model.parameters():
        p.device_mesh, p.placements = flat, (Placement(True), Placement(False))
    assert replication(model) is Replication.SHARDS   # a replicated dimension of size 1 holds no replicas
    for p in model.parameters():
        p.device_mesh, p.placements = Mesh([[0, 1], [2, 3]]), (Placement(True), Placement(False))
    assert replication(model) is Replication.SHARDS   # parameters on several meshes: not compared
