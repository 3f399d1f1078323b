"""A stopped rank (SIGSTOP, state T) is a hang at once, not after the hang timeout; and the ranks
of an unmodified script are alive in `ckptsup status` whether they run cold or in warm
interpreters (issue 22, the "blind" and "late" cases). In-process here; the real SIGSTOP runs are
test_supervisor_train.py and test_drop_in_local.py."""
from ckptsup.config import SupervisorConfig
from ckptsup.supervisor.job.detection import RankView, detect_hang
from ckptsup.supervisor.job.observations import FailureKind
from ckptsup.wire import Phase

CFG = SupervisorConfig()   # the defaults: hang_min_s 10 s, heartbeat_interval_s 1 s


def view(r, *, stopped_since=None, last=100.0):
    return RankView(rank=r, node=f"n{r}", phase=Phase.TRAIN, phase_since=0.0, last_step=9, last_progress=last,
                    stopped=stopped_since is not None, stopped_since=stopped_since)


def test_a_rank_stopped_through_two_heartbeats_is_a_hang_at_once():
    ranks = [view(0), view(1, stopped_since=101.0)]
    assert detect_hang(ranks, now=101.5, config=CFG, train_timeout_s=30.0) is None   # one heartbeat: maybe a stop-and-continue
    f = detect_hang(ranks, now=102.0, config=CFG, train_timeout_s=30.0)
    assert f.kind is FailureKind.HANG and f.rank == 1 and f.node == "n1" and f.detect_s == 1.0
    assert "state T" in f.detail and "process stopped" in f.detail


def test_a_continued_rank_is_no_longer_a_hang():
    assert detect_hang([view(0), view(1)], now=102.0, config=CFG, train_timeout_s=30.0) is None
