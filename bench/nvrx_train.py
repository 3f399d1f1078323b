"""examples/train.py with NVIDIA NVRx heartbeats (for bench_detect/bench_restart's ft_launcher
baseline): every completed step also calls RankMonitorClient.send_heartbeat(), as the NVRx docs
ask of a workload. Same model, data and step loop as the other tools run."""
import runpy
import sys
from pathlib import Path

from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

import ckptsup.hooks.session as session

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train.py"
client = RankMonitorClient()
client.init_workload_monitoring()
_step_done = session.Run.step_done


def step_done(self, step, **kwargs):
    _step_done(self, step, **kwargs)
    client.send_heartbeat()


session.Run.step_done = step_done
sys.argv = [str(TRAIN), *sys.argv[1:]]
try:
    runpy.run_path(str(TRAIN), run_name="__main__")
finally:
    client.shutdown_workload_monitoring()
