"""The HF Trainer's TrainerState in a ckptsup checkpoint, and reading it back before train().

HF positions its data inside `Trainer.train()`, before any callback runs: from the
`trainer_state.json` of the folder passed as `resume_from_checkpoint` it derives the epochs and
batches to skip (accelerate's `skip_first_batches`). So the TrainerState rides in every ckptsup
checkpoint as the extra `hf_trainer_state`, and `choose_checkpoint` reads it out of the newest
usable checkpoint — through the same checks as a resume (trust, strict manifest, sizes, level-2
structure, the `.metadata` hash before its allow-listed unpickling, the item's own hash before its
bytes are decoded) — so that `resume_path` can hand HF a folder holding nothing but that JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint.catalog import Status, list_checkpoints
from ..checkpoint.hf_folder import HF_FOLDER   # one name rule for HF's folders, here and before a launch
from ..checkpoint.trust import CheckpointDirUntrusted, check_checkpoint_dir, private_mkdir
from ..checkpoint.validate import quarantine
from ..errors import CheckpointError
from ..hooks import jsontensor
from ..hooks.state import EXTRA_PREFIX

log = logging.getLogger("ckptsup.integrations.hf")

STATE_EXTRA = "hf_trainer_state"
STATE_NAME = "trainer_state.json"      # transformers.trainer.TRAINER_STATE_NAME
RESUME_DIR = "hf_resume"               # <checkpoint_dir>/hf_resume/rank<r>/trainer_state.json
# set from the current run by HF itself (TrainerState.init_training_references), never restored
PER_RUN_FIELDS = frozenset({"is_local_process_zero", "is_world_process_zero", "max_steps", "num_train_epochs",
                            "trial_name", "trial_params"})


class TrainerStateExtra:
    """The live TrainerState as a ckptsup extra (state_dict / load_state_dict). Rank 0's copy is
    saved; on load the per-process fields stay this process's own."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.state)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for name, value in saved.items():
            if name not in PER_RUN_FIELDS and hasattr(self.state, name):
                setattr(self.state, name, value)


@dataclass
class Choice:
    """What rank 0 found; the same object reaches every rank."""

    path: str | None = None                 # the checkpoint to resume from (None: a fresh start)
    step: int = 0
    state: dict[str, Any] | None = None     # its TrainerState
    rejected: list[tuple[str, str]] = field(default_factory=list)   # (path, reason): corrupt, quarantined
    error: str | None = None                # a failure every rank raises (one line)
    memory_step: int | None = None          # the memory tier's copy of this step (path: memory:step_N)
    framework: str = ""                     # path is HF's own checkpoint-N, HF loads it (how it was validated)
    external: list[tuple[str, int | None, str, str]] = field(default_factory=list)   # checkpoint-N refused:
                                            # (name, step, reason, where it was moved)


def candidates(checkpoint_dir: Path, resume_from: str | None) -> list[str]:
    """Newest first: the supervisor's CKPTSUP_RESUME_FROM, then every committed or validated
    step_<N> (the order Run.resume tries them in)."""
    paths = [resume_from] if resume_from else []
    if not check_checkpoint_dir(checkpoint_dir):
        return paths
    infos = [i for i in list_checkpoints(checkpoint_dir) if i.status in (Status.COMMITTED, Status.VALIDATED)]
    paths.extend(str(i.path) for i in reversed(infos) if str(i.path) not in paths)
    return paths


def read_trainer_state(step_dir: Path) -> dict[str, Any]:
    """The TrainerState saved in `step_dir`, verified before anything is decoded. Raises the
    loader's classification: corruption (ValidationError/ManifestError), untrusted (TrustError),
    or CheckpointError (anything else: e.g. a checkpoint written without this callback)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ..hooks.dcp_errors import failure_errors
    from ..hooks.loader import _classify
    from ..hooks.reader import VerifyingReader, safe_load_planner

    key = EXTRA_PREFIX + STATE_EXTRA
    try:
        reader = VerifyingReader(step_dir)
        entry = reader.read_metadata().state_dict_metadata.get(key)
        if entry is None:
            raise CheckpointError(f"{step_dir.name} holds no HF TrainerState: it was not written by "
                                  "ckptsup.integrations.hf.CkptsupCallback; move it aside or use another checkpoint_dir")
        target = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
        with warnings.catch_warnings():   # rank 0 alone reads it, on purpose
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(target, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
    except failure_errors() as err:
        raise _classify(step_dir, err) from None
    state = jsontensor.from_tensor(target[key])
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise CheckpointError(f"{step_dir.name}: its HF TrainerState has no integer global_step")
    return state


def choose_checkpoint(checkpoint_dir: Path, resume_from: str | None) -> Choice:
    """Rank 0: the newest checkpoint whose TrainerState reads back verified. A corrupt one is
    quarantined at once (the Run reports it at attach) and the previous is tried; an untrusted
    one is skipped; anything else stops the run, as in Run.resume."""
    from ..checkpoint.commit import parse_step
    from ..hooks.loader import is_corruption, is_untrusted

    choice = Choice()
    untrusted: list[str] = []
    try:
        paths = candidates(checkpoint_dir, resume_from)
    except CheckpointDirUntrusted as err:
        return Choice(error=str(err))
    for path in paths:
        try:
            state = read_trainer_state(Path(path))
        except Exception as err:  # noqa: BLE001 - classified below, as the loader does
            log.error("ckptsup: cannot resume from %s: %s", path, err)
            if is_untrusted(err):
                untrusted.append(path)
                continue
            if not is_corruption(err):
                choice.error = str(err)
                return choice
            _quarantine(Path(path), str(err))
            choice.rejected.append((path, str(err)))
            continue
        step = parse_step(Path(path).name)
        if step is not None and step != state["global_step"]:
            choice.error = (f"{Path(path).name} holds TrainerState.global_step {state['global_step']}: it was saved with "
                            "another step numbering than the HF callback's; use a checkpoint_dir of its own")
            return choice
        choice.path, choice.step, choice.state = path, state["global_step"], state
        return choice
    if untrusted:
        choice.error = (f"no checkpoint to resume from but {len(untrusted)} untrusted one(s), newest {untrusted[0]}; "
                        "fix their owner/mode (see the log above) or move them aside")
    return choice


def _quarantine(path: Path, reason: str) -> None:
    if not path.is_dir():
        return
    try:
        log.error("ckptsup: quarantined %s as %s", path, quarantine(path, reason))
    except (CheckpointError, OSError) as err:
        log.error("ckptsup: could not quarantine %s: %s", path, err)


def write_state_folder(checkpoint_dir: Path, rank: int, state: dict[str, Any]) -> Path:
    """<checkpoint_dir>/hf_resume/rank<r>/trainer_state.json (dirs 0700, file 0600): all HF reads
    from the folder it is given; the weights stay in the ckptsup checkpoint only."""
    folder = private_mkdir(private_mkdir(checkpoint_dir / RESUME_DIR) / f"rank{rank}")
    tmp = folder / f".{STATE_NAME}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / STATE_NAME)
    return folder


# ---- the memory tier (docs/integrations.md §Hugging Face: resume from memory) ---------------------

def memory_client(settings: Any, env: Any, rank: int) -> Any:
    """This rank's client of its agent's memory store, as Run builds it; None when the tier is off
    (no [memory] enabled, or no agent: plain torchrun)."""
    from ..hooks.memory_tier import MemoryClient

    config = settings.config
    if config is None or not config.memory.enabled or not env.memory_socket:
        return None
    return MemoryClient(socket_path=env.memory_socket, secret_file=env.secret_file, rank=rank)


def held_steps(client: Any) -> list[tuple[int, str]]:
    """What this rank's agent (and its peers) hold; [] when the agent cannot say (the disk decides)."""
    from ..errors import CkptsupError

    if client is None:
        return []
    try:
        return client.held()
    except (CkptsupError, OSError) as err:
        log.warning("ckptsup: cannot ask the agent for memory checkpoints: %s", err)
        return []


def read_memory_trainer_state(client: Any, step: int) -> dict[str, Any]:
    """Rank 0: the TrainerState in its memory bundle of `step` (its agent's copy, else a peer's),
    verified as a resume verifies it (BundleReader: sizes, .metadata hash before the allow-list
    unpickler, the item's hash before it is decoded)."""
    from ..hooks.memory_tier import BundleReader

    last: Exception | None = None
    for from_peers in (False, True):
        try:
            return _state_from_reader(BundleReader(client.get(step, from_peers=from_peers)), f"memory step_{step}")
        except Exception as err:  # noqa: BLE001 - any failure: the next source, then the disk
            last = err
    raise CheckpointError(f"memory checkpoint of step {step}: {last}")


def _state_from_reader(reader: Any, name: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    from ..hooks.reader import safe_load_planner

    key = EXTRA_PREFIX + STATE_EXTRA
    entry = reader.read_metadata().state_dict_metadata.get(key)
    if entry is None:
        raise CheckpointError(f"{name} holds no HF TrainerState")
    target = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(target, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
    state = jsontensor.from_tensor(target[key])
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise CheckpointError(f"{name}: its HF TrainerState has no integer global_step")
    return state


def prefer_memory(disk: Choice, common: tuple[int, str] | None, read_state: Any) -> Choice:
    """Rank 0: the newest memory copy every rank holds wins when no usable disk checkpoint is
    newer (Run.resume's rule); its TrainerState read back verified, else the disk choice stands."""
    if common is None or disk.error or (disk.path is not None and common[0] < disk.step):
        return disk
    step = common[0]
    try:
        state = read_state(step)
    except Exception as err:  # noqa: BLE001 - the memory copy is a shortcut: the disk is the fallback
        log.warning("ckptsup: %s; resuming from disk", err)
        return disk
    if state["global_step"] != step:
        log.warning("ckptsup: memory checkpoint of step %d holds TrainerState.global_step %d; resuming from disk",
                    step, state["global_step"])
        return disk
    return Choice(path=f"memory:step_{step}", step=step, state=state, rejected=disk.rejected, memory_step=step)


# ---- HF's own checkpoint-N folders (save_strategy other than "no"; framework_ckpt.py) -------------

def hf_folders(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of HF's checkpoint-N folders in output_dir, newest first."""
    try:
        names = [entry.name for entry in os.scandir(output_dir) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    found = [(int(m.group(1)), Path(output_dir) / name) for name in names if (m := HF_FOLDER.fullmatch(name))]
    return sorted(found, reverse=True)


def test_load_hf_folder(folder: Path) -> dict[str, Any]:
    """Read back what HF's resume reads, without unpickling anything: every safetensors file in
    full, every torch.save archive's members (their CRC-32s checked by zipfile), the TrainerState.
    Returns the TrainerState; raises on anything unreadable."""
    import zipfile

    from safetensors.torch import load_file

    state: dict[str, Any] | None = None
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            load_file(str(path), device="cpu")
        elif path.suffix in (".pt", ".pth", ".bin") and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
                if bad is not None:
                    raise CheckpointError(f"{path.name}: member {bad} fails its CRC-32")
        elif path.name == STATE_NAME:
            state = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise CheckpointError(f"{folder.name} has no {STATE_NAME} with an integer global_step")
    return state


def prefer_hf_folder(choice: Choice, output_dir: Path, recorder: Any) -> Choice:
    """Rank 0: HF's newest checkpoint-N newer than ckptsup's choice that passes its hashes (none
    recorded: hashed now, adopted) and a test load wins; a bad one is moved aside and the next tried."""
    if choice.error:
        return choice
    for step, folder in hf_folders(output_dir):
        if step <= choice.step:
            break
        verdict = recorder.verify(folder)
        problems = list(verdict.problems)
        state: dict[str, Any] | None = None
        if not problems:
            try:
                state = test_load_hf_folder(folder)
            except Exception as err:  # noqa: BLE001 - anything unreadable is a bad checkpoint
                problems = [f"{folder.name}: test load failed: {type(err).__name__}: {str(err)[:200]}"]
        if problems or state is None:
            reason = problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            choice.external.append((folder.name, step, reason, recorder.reject(folder, reason)))
            continue
        return dataclasses.replace(choice, path=str(folder), step=int(state["global_step"]), state=state,
                                   memory_step=None, framework=verdict.how)
    return choice
