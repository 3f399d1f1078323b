"""Silent data corruption as the supervisor sees it (docs/sdc.md): a rank's `sdc` frame (the
replicas' fingerprints disagree) becomes a Failure naming the step, the ranks and their nodes.
Pure; the policy's rules for it are in policy.py (`sdc_action`)."""

from __future__ import annotations

from typing import Any, Mapping

from ...messages import Sdc

from .observations import Dispute, Failure, FailureKind


def sdc_failure(body: Sdc, *, node: str, nodes_of: Mapping[int, str]) -> Failure:
    """`nodes_of`: the node of every rank the attempt has heard from. With a majority the failure
    is pinned on the (first) outvoted rank's node and every outvoted node is a suspect; without
    one (two copies, or no strict majority) nothing is pinned and the disputed nodes are listed."""
    step, copies, disputed, majority = body.step, body.copies, list(body.disputed), body.majority
    dispute = Dispute(ranks=tuple(disputed), agreed_step=body.agreed_step)
    where = sorted({nodes_of.get(r, node) for r in disputed})
    ranks = ", ".join(str(r) for r in disputed)
    if majority:
        first = disputed[0] if disputed else None
        detail = (f"replicas disagree at step {step}: rank(s) {ranks} on {', '.join(where)} differ from the majority of "
                  f"{copies} copies")
        return Failure(kind=FailureKind.SDC, node=nodes_of.get(first, node) if first is not None else None,
                       rank=first, step=step, suspects=tuple(where), detail=detail, dispute=dispute)
    detail = (f"replicas disagree at step {step}: {copies} copies and no majority (ranks {ranks} on "
              f"{', '.join(where)}); rerun from the last agreed checkpoint to tell")
    return Failure(kind=FailureKind.SDC, step=step, suspects=tuple(where), detail=detail, dispute=dispute)


def is_majority(failure: Failure | None) -> bool:
    """An sdc failure pinned on a node (the majority named it)."""
    return failure is not None and failure.kind is FailureKind.SDC and failure.node is not None


def sdc_fields(failure: Failure) -> dict[str, Any]:
    """The `failure_detected` fields of an sdc failure beyond the common ones (docs/contracts.md):
    `ranks` and `nodes` in dispute, and `agreed_step` when a check of the attempt had agreed."""
    if failure.kind is not FailureKind.SDC or failure.dispute is None:
        return {}
    out: dict[str, Any] = {"ranks": list(failure.dispute.ranks), "nodes": list(failure.suspects)}
    if failure.dispute.agreed_step is not None:
        out["agreed_step"] = failure.dispute.agreed_step
    return out


def sdc_cost(sdc_s: float | None) -> dict[str, Any]:
    """`sdc_s` for the events that close or sample an attempt (step_progress, failure_detected,
    run_complete, run_cancelled): rank 0's fingerprint seconds so far in it; {} when not measured."""
    return {} if sdc_s is None else {"sdc_s": round(sdc_s, 6)}
