"""Silent data corruption as the supervisor sees it (docs/sdc.md): a rank's `sdc` frame (the
replicas' fingerprints disagree) becomes a Failure naming the step, the ranks and their nodes.
Pure; the policy's rules for it are in policy.py (`sdc_action`)."""

from __future__ import annotations

from typing import Any, Mapping

from .observations import Failure, FailureKind


def sdc_failure(body: Mapping[str, Any], *, node: str, nodes_of: Mapping[int, str]) -> Failure:
    """`nodes_of`: the node of every rank the attempt has heard from. With a majority the failure
    is pinned on the (first) outvoted rank's node and every outvoted node is a suspect; without
    one (two copies, or no strict majority) nothing is pinned and the disputed nodes are listed."""
    step = int(body.get("step", -1))
    copies = int(body.get("copies", 0))
    disputed = [int(r) for r in body.get("disputed") or []]
    majority = bool(body.get("majority"))
    where = sorted({nodes_of.get(r, node) for r in disputed})
    ranks = ", ".join(str(r) for r in disputed)
    if majority:
        first = disputed[0] if disputed else None
        detail = (f"replicas disagree at step {step}: rank(s) {ranks} on {', '.join(where)} differ from the majority of "
                  f"{copies} copies")
        return Failure(kind=FailureKind.SDC, node=nodes_of.get(first, node) if first is not None else None,
                       rank=first, step=step, suspects=tuple(where), detail=detail)
    detail = (f"replicas disagree at step {step}: {copies} copies and no majority (ranks {ranks} on "
              f"{', '.join(where)}); rerun from the last agreed checkpoint to tell")
    return Failure(kind=FailureKind.SDC, step=step, suspects=tuple(where), detail=detail)


def is_majority(failure: Failure | None) -> bool:
    """An sdc failure pinned on a node (the majority named it)."""
    return failure is not None and failure.kind is FailureKind.SDC and failure.node is not None
