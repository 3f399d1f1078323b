"""The dev cluster's slurm.conf (pure render): partitions, preemption, timers, paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptsup.slurm.devconf import ClusterSpec, parse_slurm_version, render_cgroup_conf, render_slurm_conf


def conf(**kw) -> dict[str, str]:
    text = render_slurm_conf(ClusterSpec(dir=Path("/x/c"), **kw), controller_host="host")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, rest = line.partition("=")
            name = rest.split()[0]
            out[f"{key}={name}" if key in ("PartitionName", "NodeName") else key] = rest
    return out


def test_five_nodes_on_loopback_with_one_port_each():
    c = conf(port_base=17100)
    assert c["NodeName=n[1-5]"].startswith("n[1-5] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17101-17105]")
    assert c["SlurmctldPort"] == "17100" and c["SlurmctldHost"] == "host(127.0.0.1)"


def test_clusters_side_by_side_get_disjoint_job_ids():
    assert "FirstJobId" not in conf()            # Slurm's own default: 1
    assert conf(first_job_id=100_001)["FirstJobId"] == "100001"


def test_partitions_main_default_spares_reserved_spanning_and_preemption_pair():
    c = conf()
    assert "Nodes=n[1-4] Default=YES" in c["PartitionName=main"] and "PreemptMode=OFF" in c["PartitionName=main"]
    assert "Nodes=n5 Default=NO" in c["PartitionName=spares"] and "PreemptMode=OFF" in c["PartitionName=spares"]
    assert "Nodes=n[1-5] Default=NO" in c["PartitionName=mainspare"] and "PreemptMode=OFF" in c["PartitionName=mainspare"]
    assert "PreemptMode=REQUEUE GraceTime=30" in c["PartitionName=lowprio"]
    assert "PreemptMode=REQUEUE GraceTime=120" in c["PartitionName=lowprio120"]
    assert "PriorityTier=10" in c["PartitionName=highprio"] and "PriorityTier=1 " in c["PartitionName=lowprio"]
    # partition_prio refuses a cluster-wide OFF: REQUEUE cluster-wide, OFF per partition
    assert c["PreemptType"] == "preempt/partition_prio" and c["PreemptMode"] == "REQUEUE"


def test_short_timers_and_requeue_enabled():
    c = conf(slurmd_timeout_s=10, grace_time_s=20)
    assert c["SlurmdTimeout"] == "10" and c["KillWait"] == "5" and c["MessageTimeout"] == "5"
    assert "bf_interval=1" in c["SchedulerParameters"] and c["JobRequeue"] == "1" and c["ReturnToService"] == "2"
    assert "GraceTime=20" in c["PartitionName=lowprio"]


def test_every_path_lives_under_the_cluster_directory_and_uses_our_munge_socket():
    text = render_slurm_conf(ClusterSpec(dir=Path("/x/c")), controller_host="host")
    paths = [word.rsplit("=", 1)[1] for line in text.splitlines() if not line.startswith("#")
             for word in line.split() if "=/" in word]
    assert paths and all(p.startswith("/x/c/") or p == "/bin/true" for p in paths), paths
    assert "AuthInfo=socket=/x/c/munge/munge.socket" in text


def test_spare_count_and_node_count_shape_the_partitions():
    c = conf(nodes=8, spares=2)
    assert "Nodes=n[1-6] Default=YES" in c["PartitionName=main"]
    assert "Nodes=n[7-8]" in c["PartitionName=spares"]


def test_node_local_dir_is_per_node_under_the_cluster_dir():
    spec = ClusterSpec(dir=Path("/x/c"))
    assert spec.node_local_dir("n3") == Path("/x/c/nodes/n3/local")


def test_missing_packages_are_one_line_naming_the_apt_command(monkeypatch, tmp_path):
    import pytest

    from ckptsup.errors import DevClusterError
    from ckptsup.slurm import devcluster

    monkeypatch.setattr(devcluster, "REQUIRED_COMMANDS", ("slurmctld", "slurmd-not-installed-here"))
    with pytest.raises(DevClusterError) as err:
        devcluster.DevCluster(ClusterSpec(dir=tmp_path / "c")).up()
    assert str(err.value) == "missing slurmd-not-installed-here; install with: apt-get install slurm-wlm munge tini"
    assert not (tmp_path / "c").exists()  # nothing started, nothing written


def test_daemons_bind_to_loopback_not_every_interface():
    c = conf()
    assert c["CommunicationParameters"] == "NoCtldInAddrAny,NoInAddrAny"


def test_every_node_declares_two_gpus_backed_by_device_files_under_the_cluster_dir():
    from ckptsup.slurm.devconf import render_gres_conf

    c = conf()
    assert c["GresTypes"] == "gpu"
    assert " Gres=gpu:2 State=UNKNOWN" in c["NodeName=n[1-5]"]
    spec = ClusterSpec(dir=Path("/x/c"))
    # File= is what keeps Slurm 22.05 from dropping the GPUs (file-less GPU GRES turn the node INVAL)
    assert render_gres_conf(spec).splitlines()[1:] == ["NodeName=n[1-5] Name=gpu File=/x/c/dev/nvidia[0-1]"]
    assert spec.gres_conf == Path("/x/c/gres.conf") and spec.gpu_devices() == [Path("/x/c/dev/nvidia0"),
                                                                              Path("/x/c/dev/nvidia1")]


def test_a_cluster_without_gpus_declares_no_gres():
    from ckptsup.slurm.devconf import render_gres_conf

    c = conf(gpus_per_node=0)
    assert "GresTypes" not in c and "Gres=" not in c["NodeName=n[1-5]"]
    spec = ClusterSpec(dir=Path("/x/c"), gpus_per_node=0)
    assert len(render_gres_conf(spec).splitlines()) == 1 and spec.gpu_devices() == []
    one = render_gres_conf(ClusterSpec(dir=Path("/x/c"), gpus_per_node=1))
    assert one.splitlines()[1] == "NodeName=n[1-5] Name=gpu File=/x/c/dev/nvidia0"


@pytest.mark.parametrize("text, version", [("slurm 22.05.8\n", (22, 5)), ("slurm 24.11.5\n", (24, 11)),
                                           ("slurm-wlm 26.05.5\n", (26, 5))])
def test_slurmd_version_lines_parse(text, version):
    assert parse_slurm_version(text) == version


def test_no_version_in_the_answer_is_a_value_error():
    with pytest.raises(ValueError, match="no Slurm version"):
        parse_slurm_version("slurmd: command not found")


def test_cgroup_plugin_is_disabled_from_24_05_and_no_file_before():
    # 22.05 refuses CgroupPlugin=disabled; 24.05+ need it where the nodes share one cgroup tree
    assert render_cgroup_conf((22, 5)) is None and render_cgroup_conf((23, 11)) is None
    for version in ((24, 5), (24, 11), (26, 5)):
        assert "CgroupPlugin=disabled" in render_cgroup_conf(version).splitlines()
