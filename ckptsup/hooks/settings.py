"""The session's settings: attach() keywords > the supervisor's environment > config files.

Each layer goes through config.apply_layer, so a bad keyword or variable gets the same one-line
error (naming the key and the valid choices) as a bad TOML value."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint.tiers import node_local_root
from ..config import apply_layer, load_config, read_config_json
from ..env import RankEnv


@dataclass(kw_only=True)
class Settings:
    checkpoint_dir: Path
    save_every_steps: int
    save_every_s: float
    async_save: bool
    hash_algorithm: str
    jitter_s: float
    emergency_margin: float
    allow_stateless_dataloader: bool
    save_timeout_s: float
    node_local_dir: Path | None = None   # node-local cache tier (checkpoint/local_cache.py); None = off
    config: Any = None            # the resolved config.Config (for the housekeeper: tiers, retention)
    provenance: dict[str, str] = field(default_factory=dict)


def resolve_settings(*, env: RankEnv, checkpoint_dir: str | None = None, save_every_steps: int | None = None,
                     save_every_s: float | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    resolved = read_config_json(env.config_json) if env.config_json else load_config()
    config, provenance = resolved.config, dict(resolved.provenance)
    from_env = {key: value for key, value in (("dir", env.checkpoint_dir), ("save_every_steps", env.save_every_steps),
                                               ("save_every_s", env.save_every_s)) if value is not None}
    apply_layer(config, provenance, {"checkpoint": from_env}, "env")
    keywords = {"dir": None if checkpoint_dir is None else str(checkpoint_dir),
                "save_every_steps": save_every_steps, "save_every_s": save_every_s, **(overrides or {})}
    apply_layer(config, provenance, {"checkpoint": {k: v for k, v in keywords.items() if v is not None}}, "attach()")
    ckpt = config.checkpoint
    if ckpt.dir:
        directory = Path(ckpt.dir)
    elif env.run_dir:
        directory = Path(env.run_dir) / "checkpoints"
    else:
        directory = Path(config.run.run_dir.replace("{job_id}", env.job_id)) / "checkpoints"
    # an explicit CKPTSUP_NODE_LOCAL_DIR (already expanded) first, else [storage] node_local for this node
    node_local = Path(env.node_local_dir) if env.node_local_dir else node_local_root(config.storage, node=env.node, job_id=env.job_id)
    return Settings(checkpoint_dir=directory, save_every_steps=ckpt.save_every_steps, save_every_s=ckpt.save_every_s,
                    async_save=ckpt.async_save, hash_algorithm=ckpt.hash_algorithm, jitter_s=ckpt.jitter_s,
                    emergency_margin=ckpt.emergency_margin,
                    allow_stateless_dataloader=ckpt.allow_stateless_dataloader,
                    save_timeout_s=config.supervisor.save_timeout_s, node_local_dir=node_local, config=config, provenance=provenance)
