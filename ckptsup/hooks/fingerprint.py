"""Replica fingerprints: silent data corruption caught by comparing the bytes replicas hold
(docs/sdc.md).

A fingerprint is integer arithmetic over the bit patterns of the parameters, buffers and optimizer
state a rank holds, on the device where they live: each tensor's bytes are viewed as int64 words
(the odd tail bytes as int64 values), laid out as rows of ROW words, and reduced in two lanes —
the column sums weighted by odd per-column constants, and the row sums weighted by odd per-row
constants — then each tensor's lanes are weighted by an odd constant of its position in the state.
All sums wrap mod 2^64. Identical tensors give identical fingerprints on every rank; one flipped
bit changes a word by ±2^k, which an odd weight keeps non-zero mod 2^64, so a single flip always
shows. No host copy of a tensor is made: only the few int64 lanes leave the device.

`verdict` is pure: from every rank's fingerprint, whether the replicas agree and, with three or
more copies, which rank(s) the majority outvotes. `grouped_verdict` does it per replica group: with
HSDP (FSDP2 on a mesh with a replicated dimension, or FSDP1's HYBRID_SHARD) the ranks that hold
the same shard form a group, and each group is compared on its own (`replica_group`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Iterator

ROW = 1 << 16            # words per row: the column lane's weights are one ROW-long vector per device
LANES = 2
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15   # odd; Weyl-sequence constant


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _odd(i: int, salt: int) -> int:
    """An odd 64-bit constant for position i (two's-complement int64)."""
    return _signed(((i + 1) * _GOLDEN + salt * 0xBF58476D1CE4E5B9) | 1)


class _Weights:
    """The per-column odd weights, one vector per device (made once: ROW int64 = 512 KiB)."""

    def __init__(self) -> None:
        self.by_device: dict[Any, Any] = {}

    def get(self, device: Any, n: int) -> Any:
        import torch

        w = self.by_device.get(device)
        if w is None:
            idx = torch.arange(ROW, dtype=torch.int64, device=device)
            w = self.by_device[device] = idx * 2 * 0x2545F4914F6CDD1D + 1   # odd, wraps
        return w[:n]


_WEIGHTS = _Weights()


def _words(t: Any) -> tuple[Any, Any]:
    """(the tensor's bytes as int64 words, its tail bytes as int64 values or None), on its device."""
    import torch

    if hasattr(t, "to_local"):   # a DTensor: this rank's shard
        t = t.to_local()
    if t.is_sparse or t.layout != torch.strided:
        t = t.to_dense()
    if not t.is_contiguous():
        t = t.contiguous()       # a device copy, never a host one
    raw = t.reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:         # a storage offset not 8-aligned: realign by a device copy
        words = raw[:whole].clone().view(torch.int64)
    tail = raw[whole:].to(torch.int64) if whole < raw.numel() else None
    return words, tail


def tensor_lanes(t: Any) -> Any:
    """The two int64 lanes of one tensor, on its device (a 2-element tensor)."""
    import torch

    words, tail = _words(t)
    device = words.device
    rows = words.numel() // ROW
    body = words[: rows * ROW].view(rows, ROW) if rows else None
    rest = words[rows * ROW:]
    col = torch.zeros((), dtype=torch.int64, device=device)
    row = torch.zeros((), dtype=torch.int64, device=device)
    if body is not None:
        col = col + (body.sum(dim=0) * _WEIGHTS.get(device, ROW)).sum()
        row_w = torch.arange(rows, dtype=torch.int64, device=device) * 2 * 0x2545F4914F6CDD1D + 1
        row = row + (body.sum(dim=1) * row_w).sum()
    if rest.numel():
        col = col + (rest * _WEIGHTS.get(device, rest.numel())).sum()
        row = row + rest.sum() * _signed(2 * rows * 0x2545F4914F6CDD1D + 1)
    if tail is not None:
        col = col + (tail * _WEIGHTS.get(device, tail.numel())).sum() * 3
        row = row + tail.sum()
    return torch.stack([col, row])


# FSDP1's strategies whose flat shards are replicated across a second (inter-node) process group
FSDP1_HYBRID = frozenset({"HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"})


def fsdp1_modules(model: Any) -> list[Any]:
    """The FSDP1 (`FullyShardedDataParallel`) modules of `model`, outermost first ([] if none)."""
    import torch

    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FullyShardedDataParallel", None)
    return [m for m in model.modules() if isinstance(m, fsdp)] if fsdp is not None else []


def fsdp1_replicas(modules: list[Any]) -> tuple[int, ...]:
    """FSDP1 HYBRID_SHARD: the global ranks that hold this rank's flat shards (its inter-node
    group, itself included), when every FSDP module is hybrid and all share that one group; ()
    otherwise (plain FSDP1 shards, or a mix: a wrong group would be a false alarm)."""
    import torch.distributed as dist

    groups = set()
    for m in modules:
        strategy = getattr(getattr(m, "sharding_strategy", None), "name", "")
        inter = getattr(m, "_inter_node_pg", None)
        if strategy not in FSDP1_HYBRID or inter is None:
            return ()
        groups.add(tuple(sorted(dist.get_process_group_ranks(inter))))
    return groups.pop() if len(groups) == 1 else ()


def _fsdp1_local(modules: list[Any]) -> Iterator[tuple[str, Any]]:
    """Each FSDP1 module's local flat shard (outside forward/backward: what the rank holds)."""
    for i, m in enumerate(modules):
        handle = getattr(m, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if flat is not None:
            yield f"model/flat{i}", getattr(flat, "_local_shard", flat).detach()


def state_tensors(model: Any, optimizer: Any = None) -> Iterator[tuple[str, Any]]:
    """The tensors a rank holds, in an order every replica shares: the model's state dict
    (parameters and buffers), then the optimizer's per-parameter state in param-group order.
    FSDP1: the local flat shards and the buffers instead (its state_dict would gather whole
    tensors across the shard group: a collective, and not what this rank holds)."""
    import torch

    fsdp = fsdp1_modules(model)
    if fsdp:
        yield from _fsdp1_local(fsdp)
        for name, t in model.named_buffers():
            yield f"model/{name}", t.detach()
    else:
        for name, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor):
                yield f"model/{name}", t.detach()
    if optimizer is None:
        return
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in sorted(optimizer.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                if isinstance(value, torch.Tensor):
                    yield f"optim/{index}/{key}", value.detach()
            index += 1


def fingerprint(tensors: Iterable[tuple[str, Any]]) -> list[int]:
    """LANES int64 values over every tensor (names only order them; the caller keeps the order).
    The lanes stay on each tensor's device until the one transfer at the end."""
    import torch

    totals: dict[Any, Any] = {}
    for i, (_, t) in enumerate(tensors):
        if t.numel() == 0:
            continue
        lanes = tensor_lanes(t) * _odd(i, 1)
        device = lanes.device
        totals[device] = lanes if device not in totals else totals[device] + lanes
    out = [0] * LANES
    for lanes in totals.values():
        for k, v in enumerate(lanes.tolist()):   # the only device -> host transfer: LANES ints
            out[k] = _signed(out[k] + v)
    return out


class Replication(Enum):
    """What the ranks' copies of a model are to each other: REPLICAS and HYBRID are compared."""

    REPLICAS = "replicas"   # DistributedDataParallel: every rank holds the same bytes, kept so by DDP
    HYBRID = "hybrid"       # HSDP: DTensor parameters replicated along a mesh dimension, or FSDP1's
                            # HYBRID_SHARD; the ranks that hold the same shard are replicas of each
                            # other (`replica_group`)
    SHARDS = "shards"       # FSDP / FSDP2 / tensor parallel: every rank holds other bytes by design
    UNKNOWN = "unknown"     # a plain module: nothing says the ranks keep it in sync (pipeline stages,
                            # per-rank models, manual parallelism): comparing would be a false alarm


def replication(model: Any) -> Replication:
    import torch

    if any(hasattr(p, "to_local") or hasattr(p, "_local_tensor") for p in model.parameters()):
        # DTensor parameters: FSDP2, tensor parallel, HSDP
        return Replication.HYBRID if replicated_dims(model) else Replication.SHARDS
    fsdp = fsdp1_modules(model)
    if fsdp:   # FSDP1: flat shards, replicated across its inter-node group with HYBRID_SHARD
        return Replication.HYBRID if len(fsdp1_replicas(fsdp)) > 1 else Replication.SHARDS
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return Replication.REPLICAS
    return Replication.UNKNOWN


def replicated_dims(model: Any) -> tuple[int, ...]:
    """The mesh dimensions of size > 1 along which every parameter is replicated (HSDP's replicate
    dimension), when every parameter is a DTensor on one and the same mesh; () otherwise: a model
    whose parameters live on several meshes, or with plain parameters beside DTensors, is not
    compared (a wrong group would be a false alarm)."""
    meshes, placements = [], []
    for p in model.parameters():
        mesh, where = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if mesh is None or where is None:
            return ()
        meshes.append(mesh)
        placements.append(tuple(where))
    if not meshes or any(m is not meshes[0] and m != meshes[0] for m in meshes[1:]):
        return ()
    shape = tuple(meshes[0].mesh.shape)
    return tuple(d for d in range(len(shape))
                 if shape[d] > 1 and all(len(w) == len(shape) and w[d].is_replicate() for w in placements))


def replica_group(model: Any, rank: int) -> tuple[int, ...]:
    """The global ranks that hold the same bytes as `rank` (itself included), from the parameters'
    mesh: those whose mesh coordinates differ from its own only along the replicated dimensions.
    (rank,) when nothing is replicated or `rank` is not on the mesh. FSDP1 HYBRID_SHARD: its
    inter-node group. DDP: its process group (every rank, or a subgroup: data parallel inside
    one pipeline stage, whose other stages hold other bytes)."""
    import torch

    fsdp = fsdp1_modules(model)
    if fsdp:
        return fsdp1_replicas(fsdp) or (rank,)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        import torch.distributed as dist

        pg = getattr(model, "process_group", None)
        return tuple(sorted(dist.get_process_group_ranks(pg))) if pg is not None else (rank,)
    dims = replicated_dims(model)
    if not dims:
        return (rank,)
    mesh = next(iter(model.parameters())).device_mesh
    ranks = mesh.mesh
    where = (ranks == rank).nonzero()
    if where.numel() == 0:
        return (rank,)
    coordinate = where[0].tolist()
    index = tuple(slice(None) if d in dims else coordinate[d] for d in range(ranks.dim()))
    return tuple(sorted(int(r) for r in ranks[index].reshape(-1).tolist()))


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What the replicas' fingerprints say at one step."""

    copies: int
    agree: bool
    odd: tuple[int, ...] = ()        # ranks the majority outvotes (>= 3 copies, a strict majority)
    disputed: tuple[int, ...] = ()   # every rank not known good: `odd`, or all of them without a majority
    fingerprint: str = ""            # the majority's (or the only) fingerprint, hex

    @property
    def majority(self) -> bool:
        return bool(self.odd)


def fp_hex(lanes: Iterable[int]) -> str:
    return "".join(f"{v & _MASK:016x}" for v in lanes)


def verdict(fingerprints: list[tuple[int, ...]]) -> Verdict:
    """Group the ranks by fingerprint. One group: they agree. Else a strict majority (possible
    from three copies on) names the others; without one every rank is in dispute."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, fp in enumerate(fingerprints):
        groups.setdefault(tuple(fp), []).append(rank)
    copies = len(fingerprints)
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    best_fp, best = ranked[0]
    if len(groups) == 1:
        return Verdict(copies=copies, agree=True, fingerprint=fp_hex(best_fp))
    if 2 * len(best) > copies:
        odd = tuple(sorted(r for fp, ranks in ranked[1:] for r in ranks))
        return Verdict(copies=copies, agree=False, odd=odd, disputed=odd, fingerprint=fp_hex(best_fp))
    return Verdict(copies=copies, agree=False, disputed=tuple(range(copies)))


def grouped_verdict(fingerprints: list[tuple[int, ...]], keys: list[int]) -> Verdict:
    """`verdict` per replica group: the ranks with the same key hold the same bytes (HSDP: the
    same shard; DDP: one group of every rank); a negative key, or a group of one, has nothing to
    be compared with. The replicas agree when every group does. The ranks in dispute are every
    group's, as global ranks; there is a majority only when every group in dispute had one.
    `copies` is the smallest group's size, and the fingerprint the groups' majorities folded into one."""
    groups: dict[int, list[int]] = {}
    for rank, key in enumerate(keys):
        if key >= 0:
            groups.setdefault(key, []).append(rank)
    groups = {k: ranks for k, ranks in groups.items() if len(ranks) > 1}
    if not groups:
        return Verdict(copies=1, agree=True)
    if len(groups) == 1 and len(next(iter(groups.values()))) == len(fingerprints):
        return verdict(fingerprints)   # one group of every rank (DDP): the plain verdict
    copies = min(len(ranks) for ranks in groups.values())
    folded, odd, disputed, majority = [0] * LANES, [], [], True
    for key, ranks in sorted(groups.items()):
        v = verdict([fingerprints[r] for r in ranks])
        if v.fingerprint:
            for k in range(LANES):
                folded[k] = _signed(folded[k] + int(v.fingerprint[16 * k:16 * k + 16], 16) * _odd(key, 2))
        if not v.agree:
            disputed += [ranks[i] for i in v.disputed]
            odd += [ranks[i] for i in v.odd]
            majority = majority and v.majority
    if not disputed:
        return Verdict(copies=copies, agree=True, fingerprint=fp_hex(folded))
    if majority:
        return Verdict(copies=copies, agree=False, odd=tuple(sorted(odd)), disputed=tuple(sorted(odd)),
                       fingerprint=fp_hex(folded))
    return Verdict(copies=copies, agree=False, disputed=tuple(sorted(disputed)))


def flip_bit(model: Any, *, param: int = 0, index: int = 0, bit: int = 20) -> None:
    """Flip one bit of one parameter in place (test fault injection: CKPTSUP_TEST_FLIP_BIT)."""
    import torch

    p = list(model.parameters())[param]
    with torch.no_grad():
        words = p.data.view(-1).view(torch.int32)
        words[index] ^= 1 << bit


NO_REPLICA = -1   # a rank's replica key when it holds no replica: it takes part in the check, compared with nobody


class ReplicaCheck:
    """One rank's side of the comparison: fingerprint what it holds, all-gather the LANES int64 and
    its replica group's key with every rank on the session's gloo group, judge each group.
    Collective: every rank calls `check` at the same step (step-based, or at a save every rank
    takes). `key`: the same on every rank that must hold the same bytes (the group's lowest rank:
    0 for a DDP over every rank), NO_REPLICA for a rank with no replica (it takes part, unfingerprinted)."""

    def __init__(self, *, model: Any, optimizer: Any, rank: int, world_size: int, group: Any,
                 every_steps: int, key: int = 0) -> None:
        self.model, self.optimizer, self.key = model, optimizer, key
        self.rank, self.world_size, self.group = rank, world_size, group
        self.every_steps = every_steps
        self.last: tuple[int, Verdict] | None = None   # (state after N steps, its verdict): one check per state
        self.checks = 0
        self.seconds = 0.0     # fingerprinting + exchange, all checks together (rank 0's `step` frames: sdc_s)
        self.agreed: int | None = None   # steps done at the last check that agreed (the sdc frame's agreed_step + 1)

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and (step + 1) % self.every_steps == 0

    def check(self, steps_done: int) -> Verdict:
        """The verdict on the state after `steps_done` steps (computed once per state)."""
        import time

        if self.last is not None and self.last[0] == steps_done:
            return self.last[1]
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        lanes = fingerprint(state_tensors(self.model, self.optimizer)) if self.key >= 0 else [0] * LANES
        mine = torch.tensor([*lanes, self.key], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        rows = [t.tolist() for t in gathered]
        result = grouped_verdict([tuple(r[:LANES]) for r in rows], [int(r[LANES]) for r in rows])
        self.seconds += time.perf_counter() - t0
        self.checks += 1
        self.last = (steps_done, result)
        if result.agree:
            self.agreed = steps_done
        return result


def record(v: Verdict) -> dict[str, Any]:
    """The manifest's `replicas` entry (checkpoint/validate.py REPLICAS_KEY)."""
    out: dict[str, Any] = {"agree": v.agree, "copies": v.copies, "fingerprint": v.fingerprint}
    if not v.agree:
        out["disputed"] = list(v.disputed)
        out["majority"] = v.majority
    return out
