"""The checkpoints a job writes itself, which ckptsup checks but does not write — each configured
or not, and the loop asks this one place about all of them:

  external   a framework's own DCP step folders (`[checkpoint] external_dir`, e.g. torchtitan's):
             hashed by the agents after each save (external_watch.py), the newest that validates
             made the framework's "latest" before each launch (external_resume.py)
  hf         Hugging Face's checkpoint-N folders (`[checkpoint] hf_output_dir`): bad ones moved out
             of get_last_checkpoint's way before each launch (hf_resume.py)
  script     the script's own files (`[supervisor] script_checkpoint`): kept and checked, put back
             or given up on before each launch, resume arguments added (script_checkpoint.py)

What each does is in its module; this holds the three and says when each is asked.
"""

from __future__ import annotations

from typing import Any, Callable

from ...config import Config
from ...messages import ExtHashed
from ...rundir import RunDir
from .agent_set import AgentSet
from .external_resume import Await, ExternalResume
from .external_watch import ExternalCheckpoints, resolve_dir
from .hf_resume import HfCheckpoints
from .operating import Emit
from .script_checkpoint import ScriptCheckpoints


class OwnCheckpoints:
    def __init__(self, *, config: Config, cwd: str, script_args: list[str], run_dir: RunDir, job_id: str,
                 agents: AgentSet, clock: Callable[[], float], emit: Emit, await_answers: Await) -> None:
        self.sup = sup = config.supervisor
        self.agents = agents
        external_dir = resolve_dir(config, cwd)
        self.external = None if external_dir is None else ExternalCheckpoints(
            config=config, directory=external_dir, run_dir=run_dir.path, emit=emit, clock=clock)
        self.external_resume = None if self.external is None else ExternalResume(
            watch=self.external, agents=agents, run_dir=run_dir.path, job_id=job_id,
            nproc_per_node=int(sup.nproc_per_node), load_timeout_s=sup.load_timeout_s, clock=clock,
            emit=emit, await_answers=await_answers)
        # auto: the script's --output_dir
        self.hf = HfCheckpoints.from_config(config, cwd=cwd, script_args=script_args, emit=emit)
        self.script = ScriptCheckpoints.from_config(config, cwd=cwd, run_dir=run_dir.path, emit=emit)

    def script_refusal(self) -> str | None:
        """Before a launch (and its backoff): the script's own files whole, or put back; the reason
        to give up when one is corrupt with no verified copy."""
        return self.script.before_launch() if self.script is not None else None

    def before_launch(self, nodes: tuple[str, ...], *, attempt: int, epoch: int) -> None:
        """Bad external step folders and checkpoint-N folders out of the framework's way."""
        if self.external_resume is not None:
            self.external_resume.before_launch(nodes, attempt=attempt, epoch=epoch)
        if self.hf is not None:
            self.hf.before_launch(world_size=len(nodes) * int(self.sup.nproc_per_node))

    def script_args(self, script_args: list[str]) -> list[str]:
        """The script's arguments for the coming attempt: with resume_args when its checkpoint is in place."""
        return self.script.args(script_args) if self.script is not None else list(script_args)

    def tick(self, *, active: tuple[str, ...], ids: Callable[[], dict[str, Any]], step: int | None) -> None:
        """Every loop tick: new external step folders hashed on the agents; the script's versions
        its watcher kept, with the last progress step."""
        if self.external is not None and active:
            self.external.poll(send=self.agents.send, has_agent=self.agents.has_agent, nodes=active,
                               nproc_per_node=int(self.sup.nproc_per_node), ids=ids())
        if self.script is not None:
            self.script.tick(step=step)

    def on_answer(self, node: str, body: ExtHashed) -> None:
        if self.external is not None:
            self.external.on_answer(node, body)

    def hf_saved(self, *, since_wall: float) -> bool:
        """HF finished a save of its own since `since_wall` (trainer_state.json, written last, is new)."""
        return self.hf is not None and self.hf.progressed(since_wall=since_wall)

    def close(self) -> None:
        if self.script is not None:
            self.script.close()
