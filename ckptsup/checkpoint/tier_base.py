"""What every storage tier shares: the `Tier` protocol, its kinds, its error and the expansion of
tier paths. `tiers.py` (directory tiers, restore, the factory) and `s3tier.py` (the object tier)
both build on this module, so neither has to import the other to know what a tier is.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Protocol

from ..errors import CheckpointError
from .manifest import Manifest


class TierError(CheckpointError):
    """A tier could not be reached or answered with an error (network, credentials, server).
    Transient by nature: the promoter retries it; restore skips to the next tier."""


class TierKind(enum.Enum):
    NODE_LOCAL = "node_local"
    SHARED = "shared"
    OBJECT = "object"


class Tier(Protocol):
    name: str
    kind: TierKind

    def put(self, step_dir: Path) -> None:
        """Copy a committed step dir here; the manifest is published last."""

    def has_copy(self, step: int, manifest: Manifest) -> bool:
        """A complete copy of exactly this checkpoint (same checkpoint_id, sizes, hashes)."""

    def fetch(self, step: int, dest_dir: Path) -> Path:
        """Copy step_<N> into checkpoint dir dest_dir (verified); returns dest_dir/step_<N>."""

    def list_steps(self) -> list[int]: ...

    def delete(self, step: int) -> None: ...

    def get_manifest(self, step: int) -> Manifest | None: ...


def expand_tier_path(template: str, *, node: str = "", job_id: str = "") -> str:
    """`{node}` and `{job_id}` in a tier path; anything else in braces is refused."""
    try:
        return template.format(node=node, job_id=job_id)
    except (KeyError, IndexError, ValueError) as err:
        raise CheckpointError(f"tier path {template!r}: only {{node}} and {{job_id}} may be used ({err})") from None
