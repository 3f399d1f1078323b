"""step_completion.py: before the job ends, Slurm has finished the agents' step that lost a node
(its tree waits a minute for the dead node's report; a job ending sooner has Slurm drain healthy
nodes 'Kill task failed'). The real behaviour: tests/test_supervisor_slurm_lost_step.py."""

from __future__ import annotations

import pytest

from ckptsup.errors import SlurmCommandError
from ckptsup.slurm.parsers import StepInfo, parse_squeue_steps
from ckptsup.supervisor.job import step_completion
from ckptsup.supervisor.job.step_completion import (AGENTS_STEP_NAME, StepWait, tree_bound_s, tree_waits,
                                                    wait_budget_s, wait_for_agent_steps)


def test_squeue_steps_are_parsed_and_odd_lines_skipped() -> None:
    text = ("950008.0|ckptsup-agents|n[1-3,5]\n"
            "950008.batch|batch|n1\n"
            "\n"
            "garbage without separators\n"
            "950008.1|sleep|n2\n")
    steps = parse_squeue_steps(text)
    assert [s.step_id for s in steps] == ["950008.0", "950008.batch", "950008.1"]
    assert steps[0] == StepInfo(step_id="950008.0", name=AGENTS_STEP_NAME, nodes=["n1", "n2", "n3", "n5"])


def test_only_a_step_of_the_trees_width_or_more_reports_up_a_tree_that_waits_for_a_dead_node():
    # 22.05: a 4-node step that lost n3 left squeue the moment its srun ended; one of 15 that lost n8
    # 66 s later; a 3-node one stayed listed until the job ended, with nothing of it left on the nodes
    assert not tree_waits(3) and not tree_waits(6)
    assert tree_waits(7) and tree_waits(9) and tree_waits(15) and tree_waits(16_384)


def test_the_bound_covers_the_trees_minute_and_a_level_more_as_the_step_grows() -> None:
    assert tree_bound_s(1) == tree_bound_s(2) == 60 + 3 + 10
    assert tree_bound_s(15) == 60 + 3 * 4 + 10           # what the dev cluster's 15-node step took: 64-66 s
    assert tree_bound_s(16_384) == 60 + 3 * 14 + 10
    assert tree_bound_s(16_385) > tree_bound_s(16_384)


def test_the_wait_never_runs_past_the_time_limit_less_a_requeues_margin() -> None:
    assert wait_budget_s(step_nodes=15, now=1000.0, end_time=None) == tree_bound_s(15)
    assert wait_budget_s(step_nodes=15, now=1000.0, end_time=1000.0 + 3600) == tree_bound_s(15)
    assert wait_budget_s(step_nodes=15, now=1000.0, end_time=1000.0 + 45) == 45 - step_completion.TIME_LIMIT_MARGIN_S
    assert wait_budget_s(step_nodes=15, now=1000.0, end_time=1005.0) == 0.0


class Steps:
    """squeue --steps as a script of answers, one a poll (the last one repeats); an exception is raised."""

    def __init__(self, *answers: list[StepInfo] | Exception) -> None:
        self.answers = list(answers)
        self.polls = 0

    def job_steps(self, job_id: str) -> list[StepInfo]:
        assert job_id == "77"
        answer = self.answers[min(self.polls, len(self.answers) - 1)]
        self.polls += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


AGENTS = StepInfo(step_id="77.16", name=AGENTS_STEP_NAME, nodes=["n1", "n2"])
WATCHDOG = StepInfo(step_id="77.0", name="ckptsup", nodes=["n2"])
BATCH = StepInfo(step_id="77.batch", name="batch", nodes=["n1"])


def test_no_agents_step_listed_ends_the_wait_at_once_whatever_else_runs(capsys) -> None:
    clock = Clock()
    wait = wait_for_agent_steps(Steps([WATCHDOG, BATCH]), "77", budget_s=73, lost=["n8"], clock=clock, sleep=clock.sleep)
    assert wait == StepWait(finished=True, waited_s=0.0, budget_s=73)
    assert capsys.readouterr().out == ""   # nothing to say when there was nothing to wait for


def test_the_wait_polls_until_slurm_lists_the_agents_step_no_more(capsys) -> None:
    clock = Clock()
    steps = Steps([AGENTS, BATCH], [AGENTS, BATCH], [AGENTS, BATCH], [BATCH])
    wait = wait_for_agent_steps(steps, "77", budget_s=73, lost=["n8"], clock=clock, sleep=clock.sleep)
    assert wait.finished and wait.waited_s == pytest.approx(3 * step_completion.POLL_S) and steps.polls == 4
    out = capsys.readouterr().out
    assert "waiting up to 73 s for Slurm to finish the agents' step that ran on n8 (lost)" in out
    assert "Kill task failed" in out and "Slurm finished the agents' step 3.0 s after" in out


def test_a_step_still_listed_when_the_budget_is_spent_is_named_and_the_job_ends_anyway(capsys) -> None:
    clock = Clock()
    wait = wait_for_agent_steps(Steps([AGENTS, BATCH]), "77", budget_s=2.5, lost=["n8", "n9"], clock=clock,
                                sleep=clock.sleep)
    assert not wait.finished and wait.left == ("77.16",) and wait.waited_s == pytest.approx(2.5)
    assert wait.as_event() == {"finished": False, "waited_s": 2.5, "budget_s": 2.5, "left": ["77.16"]}
    out = capsys.readouterr().out
    assert "still lists the agents' step 77.16 after 2 s; ending the job anyway" in out
    assert "State=RESUME" in out


def test_a_failed_query_is_asked_again_and_never_counts_as_finished(capsys) -> None:
    clock = Clock()
    busy = SlurmCommandError(["squeue"], 1, "slurm_load_jobs error: Socket timed out")
    wait = wait_for_agent_steps(Steps(busy, [BATCH]), "77", budget_s=10, lost=["n8"], clock=clock, sleep=clock.sleep)
    assert wait.finished and wait.waited_s == pytest.approx(1.0)
    clock = Clock()
    wait = wait_for_agent_steps(Steps(busy), "77", budget_s=2, lost=["n8"], clock=clock, sleep=clock.sleep)
    assert not wait.finished and wait.left == () and "timed out" in wait.error
    assert "query failed" in capsys.readouterr().out


def test_a_zero_budget_asks_once_and_does_not_sleep() -> None:
    clock = Clock()
    wait = wait_for_agent_steps(Steps([AGENTS]), "77", budget_s=0.0, lost=["n8"], clock=clock, sleep=clock.sleep)
    assert not wait.finished and clock.now == 0.0
