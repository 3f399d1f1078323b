"""Where the shipped templates and site configs are: packaged under ckptsup/_data (symlinks to
the top-level folders in a source checkout)."""

from __future__ import annotations

from pathlib import Path

_DATA = Path(__file__).resolve().parent / "_data"


def sbatch_templates_dir() -> Path:
    return _DATA / "sbatch_templates"


def site_config_dir() -> Path:
    return _DATA / "site_config"
