"""checkpoint/external.py and the supervisor's watch, without processes: names and their order,
which node hashes what, the manifest kept in the run dir (round trip, confinement, hostile files
through safe_io), the cheap and the hash checks, moving a folder out of the framework's folder,
and a purge while a folder is hashed."""
import dataclasses
import os
import re
import stat
from pathlib import Path

import pytest

from ckptsup.checkpoint import external as ext
from ckptsup.config import load_config
from ckptsup.errors import ConfigError
from ckptsup.supervisor.node.external_agent import ExternalRequestError, answer, parse_request
from ckptsup.supervisor.job.external_watch import ExternalCheckpoints
from ckptsup.messages import ExtHash
from ckptsup.wire import FrameError, MessageKind

PATTERN = ext.compile_pattern(ext.DEFAULT_PATTERN)


def dcp_folder(root: Path, name: str, ranks: int = 2, payload: bytes = b"x" * 64) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for r in range(ranks):
        (folder / f"__{r}_0.distcp").write_bytes(payload + bytes([r]))
    (folder / ".metadata").write_bytes(b"pickled metadata")
    return folder


def adopt(run: Path, folder: Path, step: int) -> ext.Manifest:
    names = sorted(os.listdir(folder))
    hashed, problems = ext.hash_files(folder, names, "xxh3-128")
    assert not problems
    manifest = ext.build_manifest(ext.StepFolder(name=folder.name, step=step, path=folder), hashed,
                                  algorithm="xxh3-128", job_id="local", attempt=0, epoch=1, world_size=2,
                                  external_dir=folder.parent)
    ext.write_manifest(run, folder.name, manifest)
    return manifest


@pytest.mark.parametrize("text, problem", [
    (r"step-\d+", "exactly one group"), (r"(a)-(\d+)", "exactly one group"), (r"step-(\d+", "not a regular"),
    ("", "one group")])
def test_a_bad_external_pattern_is_one_config_line(tmp_path, text, problem):
    job = tmp_path / "job.toml"
    job.write_text(f"[checkpoint]\nexternal_pattern = '{text}'\n")
    with pytest.raises(ConfigError, match=problem) as err:
        load_config(job_config=job, env={})
    assert "\n" not in str(err.value) and "external_pattern" in str(err.value)


def test_folders_are_ordered_by_step_and_found_the_way_torchtitan_finds_them(tmp_path):
    for name in ("step-9", "step-10", "step-100", "step-8.quarantined", "other", "step-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-7").write_text("a file, not a folder")
    (tmp_path / "step-11").symlink_to(tmp_path / "step-9")   # torchtitan follows it: so do we list it
    os.mkdir(os.fsencode(tmp_path) + b"/step-12\xff")       # a name that is no UTF-8: not carried
    found = [(f.name, f.step) for f in ext.list_folders(tmp_path, PATTERN)]
    assert found == [("step-8.quarantined", 8), ("step-9", 9), ("step-10", 10), ("step-11", 11), ("step-100", 100)]
    assert ext.list_folders(tmp_path / "missing", PATTERN) == []


def test_each_node_hashes_its_own_ranks_files_and_the_first_node_the_rest():
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "__3_1.distcp",
             "__9_0.distcp", "extra.json"]
    assert ext.assign_files(names, ["n1", "n2"], 2) == {
        "n1": [".metadata", "__0_0.distcp", "__1_0.distcp", "__9_0.distcp", "extra.json"],
        "n2": ["__2_0.distcp", "__3_0.distcp", "__3_1.distcp"]}


def test_the_manifest_round_trips_outside_the_framework_folder_0600(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    folder = dcp_folder(ckpt, "step-5")
    manifest = adopt(run, folder, 5)
    path = ext.manifest_path(run, "step-5")
    assert path.parent == run / "external" and stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = ext.load_manifest(run, "step-5")
    assert loaded.to_json() == manifest.to_json()
    assert loaded.metadata_hash and loaded.extra["folder"] == "step-5"
    assert not (folder / "manifest.json").exists()          # nothing written into the framework's folder
    assert ext.check_against(folder, loaded) == []
    assert ext.load_manifest(run, "step-6") is None


def test_hostile_names_and_manifest_files_are_refused_by_name(tmp_path):
    run = tmp_path / "run"
    for bad in ("a/b", "..", "", "x" * 300, "nul\x00"):
        with pytest.raises(ext.ExternalError):
            ext.manifest_path(run, bad)
    assert ext.manifest_path(run, "..%2Fescape").parent == run / "external"   # quoted: still one file there
    (run / "external").mkdir(parents=True)
    os.mkfifo(ext.manifest_path(run, "step-1"))
    with pytest.raises(ext.ExternalError, match="FIFO"):     # never blocks
        ext.load_manifest(run, "step-1")
    ext.manifest_path(run, "step-2").symlink_to("/etc/passwd")
    with pytest.raises(ext.ExternalError, match="symlink"):
        ext.load_manifest(run, "step-2")
    ext.manifest_path(run, "step-3").write_text('{"format_version": 1}')
    with pytest.raises(ext.ExternalError, match="missing field"):
        ext.load_manifest(run, "step-3")
    for name in ("step-1", "step-2", "step-3"):
        ext.forget(run, name)                          # (a symlink there would refuse every manifest written)
    folder = dcp_folder(tmp_path / "ckpt", "step-4")
    adopt(run, folder, 4)
    os.replace(ext.manifest_path(run, "step-4"), ext.manifest_path(run, "step-44"))
    with pytest.raises(ext.ExternalError, match="not ckptsup's manifest of step-44"):
        ext.load_manifest(run, "step-44")


def test_the_cheap_check_and_the_hash_check_see_what_changed(tmp_path):
    run = tmp_path / "run"
    folder = dcp_folder(tmp_path / "ckpt", "step-5")
    manifest = adopt(run, folder, 5)
    target = folder / "__1_0.distcp"
    data = bytearray(target.read_bytes())
    data[3] ^= 0xFF
    target.write_bytes(bytes(data))                 # same size: only the hashes see it
    assert ext.check_against(folder, manifest) == []
    hashed, _ = ext.hash_files(folder, [f.path for f in manifest.files], "xxh3-128")
    problems = ext.compare_hashes("step-5", manifest, hashed)
    assert len(problems) == 1 and "__1_0.distcp" in problems[0] and "corrupted" in problems[0]
    target.write_bytes(b"short")
    (folder / "stray").write_bytes(b"")
    (folder / ".metadata").unlink()
    assert "no .metadata" in ext.check_against(folder, manifest)[0]
    (folder / ".metadata").write_bytes(b"pickled metadata")
    problems = ext.check_against(folder, manifest)
    assert any("size 5" in p for p in problems) and any("stray: present but not in its manifest" in p for p in problems)
    (folder / "stray").unlink()
    (folder / "link").symlink_to(target)
    assert "symlink" in ext.check_against(folder, manifest)[0]


def test_move_aside_takes_the_folder_out_of_the_framework_folder_with_its_reason_and_manifest(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    folder = dcp_folder(ckpt, "step-5")
    adopt(run, folder, 5)
    dest = ext.move_aside(ckpt, "step-5", "hash mismatch", run_dir=run)
    assert dest.parent == tmp_path / "ckpt.ckptsup-quarantine" and dest.name.startswith("step-5-")
    assert stat.S_IMODE(dest.parent.stat().st_mode) == 0o700
    assert not folder.exists() and (dest / "__0_0.distcp").exists()
    assert ext.list_folders(ckpt, PATTERN) == []      # re.search in the framework's folder finds nothing
    assert '"hash mismatch"' in (dest.parent / (dest.name + ext.REASON_SUFFIX)).read_text()
    assert (dest.parent / (dest.name + ext.MANIFEST_SUFFIX)).exists()
    assert ext.load_manifest(run, "step-5") is None
    (ckpt / "step-6").symlink_to(tmp_path)           # a symlink is moved as the link, never followed
    link = ext.move_aside(ckpt, "step-6", "a symlink")
    assert link.is_symlink() and tmp_path.exists()
    with pytest.raises(ext.ExternalError, match="cannot move step-7"):
        ext.move_aside(ckpt, "step-7", "gone already")


def test_manifests_of_purged_folders_are_forgotten(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    for step in (5, 10):
        adopt(run, dcp_folder(ckpt, f"step-{step}"), step)
    assert ext.forget_vanished(run, ["step-10"]) == ["step-5"]
    assert ext.known_names(run) == ["step-10"]


def test_the_agent_refuses_requests_it_cannot_carry_out_and_answers_the_rest(tmp_path):
    folder = dcp_folder(tmp_path, "step-5")
    good = {"request": "r1", "part": 0, "dir": str(tmp_path), "folder": "step-5",
            "files": ["__0_0.distcp", "gone"], "algorithm": "xxh3-128"}
    for key, bad in (("dir", "relative"), ("folder", ".."), ("files", ["../x"]), ("algorithm", "md5"),
                     ("part", True), ("files", ["f"] * 201)):
        with pytest.raises((ExternalRequestError, FrameError)):   # a wrong type: refused by messages.ExtHash
            parse_request(ExtHash.from_body({**good, key: bad}))
    reply = answer(parse_request(ExtHash.from_body(good)))
    assert [f["path"] for f in reply.files] == ["__0_0.distcp"]
    assert reply.files[0]["size"] == (folder / "__0_0.distcp").stat().st_size
    assert reply.problems == ("step-5/gone: missing",)


class FakeAgents:
    def __init__(self):
        self.sent = []

    def send(self, msg, *, nodes):
        self.sent.append((msg.KIND, nodes, msg))
        return True


def watch_of(tmp_path):
    config = load_config(env={}).config
    events = []
    watch = ExternalCheckpoints(config=config, directory=tmp_path / "ckpt", run_dir=tmp_path / "run",
                                emit=lambda name, **f: events.append((name, f)), clock=iter(range(0, 10**6, 10)).__next__)
    return watch, events


def poll(watch, agents):
    watch.poll(send=agents.send, has_agent=lambda n: True, nodes=["n1", "n2"], nproc_per_node=1,
               ids={"job_id": "local", "attempt": 0, "epoch": 1, "world_size": 2})


def test_the_watch_writes_a_manifest_once_every_node_answered_and_survives_a_purge(tmp_path):
    watch, events = watch_of(tmp_path)
    agents = FakeAgents()
    dcp_folder(tmp_path / "ckpt", "step-5")
    (tmp_path / "ckpt" / "step-10").mkdir()      # unfinished: not asked about
    poll(watch, agents)
    assert [(m, nodes, body.files) for m, nodes, body in agents.sent] == [
        (MessageKind.EXT_HASH, ["n1"], (".metadata", "__0_0.distcp")), (MessageKind.EXT_HASH, ["n2"], ("__1_0.distcp",))]
    replies = {nodes[0]: answer(parse_request(body)) for _, nodes, body in agents.sent}
    watch.on_answer("n2", dataclasses.replace(replies["n2"], request="someone else's"))   # ignored
    watch.on_answer("n1", replies["n1"])
    assert events == []
    watch.on_answer("n2", replies["n2"])
    (name, fields), = events
    assert name == "checkpoint_committed" and fields["external"] == "step-5" and fields["files"] == 3
    assert ext.load_manifest(tmp_path / "run", "step-5").world_size == 2
    # torchtitan purges a folder while it is hashed: no manifest, no complaint
    dcp_folder(tmp_path / "ckpt", "step-15")
    agents.sent.clear()
    poll(watch, agents)
    replies = {nodes[0]: answer(parse_request(body)) for _, nodes, body in agents.sent}
    import shutil
    shutil.rmtree(tmp_path / "ckpt" / "step-15")
    for node, reply in replies.items():
        watch.on_answer(node, reply)
    assert len(events) == 1 and ext.known_names(tmp_path / "run") == ["step-5"]
    shutil.rmtree(tmp_path / "ckpt" / "step-5")
    poll(watch, agents)
    assert ext.known_names(tmp_path / "run") == []
    assert re.fullmatch(r"x\d+-\d+", watch.new_request_id())


def real_dcp_folder(root: Path, name: str) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp

    folder = root / name
    state = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "step": torch.tensor(5),
             "meta": {"lr": 0.1, "milestones": [1, 2]}}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def test_the_level3_test_load_verifies_the_hashes_first_then_loads_everything(tmp_path):
    from ckptsup.supervisor.node.external_testload import run_test_load

    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    folder = real_dcp_folder(ckpt, "step-5")
    adopt(run, folder, 5)
    ok, line = run_test_load(folder, ext.manifest_path(run, "step-5"), timeout_s=120)
    assert ok and line.startswith("ok: step-5: 4 entries"), line
    meta = folder / ".metadata"
    data = bytearray(meta.read_bytes())
    data[-2] ^= 0xFF                      # a changed pickle is never unpickled: its hash says so first
    meta.write_bytes(bytes(data))
    ok, line = run_test_load(folder, ext.manifest_path(run, "step-5"), timeout_s=120)
    assert not ok and ".metadata: hash" in line, line
    # a folder whose bytes match its manifest but do not load (adopted broken): the load says so
    broken = real_dcp_folder(ckpt, "step-10")
    shard = next(p for p in broken.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:10])
    adopt(run, broken, 10)
    ok, line = run_test_load(broken, ext.manifest_path(run, "step-10"), timeout_s=120)
    assert not ok and line.startswith("test load failed"), line
