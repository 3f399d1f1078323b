"""The shipped site-config examples load cleanly, render a script, and match the dev cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.config import load_config
from ckptsup.resources import sbatch_templates_dir, site_config_dir
from ckptsup.slurm.devconf import ClusterSpec, render_slurm_conf
from ckptsup.slurm.render import params_from_config, render_sbatch

EXAMPLES = sorted((site_config_dir() / "examples").glob("*.toml"))


def test_examples_are_shipped():
    assert {p.name for p in EXAMPLES} >= {"gpu-cluster.toml", "dev-cluster.toml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_and_renders_a_script(path: Path):
    resolved = load_config(env={"CKPTSUP_SITE_CONFIG": str(path)})
    params = params_from_config(resolved.config.sbatch, run_dir=resolved.config.run.run_dir,
                                script="/home/u/train.py")
    text = render_sbatch((sbatch_templates_dir() / "train.sbatch").read_text(), params)
    assert f"#SBATCH --nodes={params.nodes + params.spares}" in text
    assert all(src.startswith("site:") for src in resolved.provenance.values())


def test_dev_cluster_example_names_partitions_the_dev_cluster_has():
    config = load_config(env={"CKPTSUP_SITE_CONFIG": str(site_config_dir() / "examples" / "dev-cluster.toml")}).config
    conf = render_slurm_conf(ClusterSpec(), controller_host="h")
    for partition in (config.sbatch.partition, config.slurm.spare_partition):
        assert f"PartitionName={partition} " in conf
    spec = ClusterSpec()
    assert config.sbatch.nodes + config.sbatch.spares <= len(spec.main_nodes)
    assert config.storage.node_local.startswith(str(spec.dir / "nodes" / "{node}" / "local"))
