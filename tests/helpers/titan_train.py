"""A small CPU training script (2 gloo ranks under torchrun) that checkpoints with torchtitan's real
`CheckpointManager`: `step-N` folders every --every steps under --folder, the latest loaded at
start (torchtitan's own fault-tolerance branch), old ones purged with keep_latest_k. torchtitan's
trainer cannot train on CPU; its checkpointer can. The script knows nothing of its supervisor (no
hooks): it is supervised at the process level plus progress lines (`step: N`, torchtitan's).

    torchrun --nproc-per-node 2 titan_train.py --steps 30 --folder D --out final.pt [--every 5]
             [--keep 3] [--step-s 0.05] [--plain-dcp] [--hold-after N --release FILE]

--plain-dcp: no torchtitan; the script's own `dcp.save` into `step-N` and `dcp.load` of the newest
folder holding `.metadata` (what a script that calls DCP itself does).
The data is a function of the step and the rank, so the final parameters of a resumed run equal
an uninterrupted run's bit for bit.
"""
import argparse
import os
import re
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


class TrainState:
    """The step counter, as torchtitan's trainer keeps it (a Stateful in `states`)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def build(args):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model


def titan_parts(args, model):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    opt_cfg = OptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01, "weight_decay": 0.01})])
    optimizers = OptimizersContainer(opt_cfg, model_parts=[model])
    schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0 / (1 + 0.01 * step))
    train_state = TrainState()
    cfg = CheckpointManager.Config(enable=True, folder=args.folder, interval=args.every, keep_latest_k=args.keep,
                                   last_save_model_only=False, async_mode="disabled")
    manager = CheckpointManager(cfg, dataloader=None, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=schedulers, states={"train_state": train_state}, sd_adapter=None)
    return optimizers, schedulers, train_state, manager


def newest_complete(folder):
    if not os.path.isdir(folder):
        return None
    steps = [int(m.group(1)) for n in os.listdir(folder) if (m := re.search(r"step-(\d+)", n))
             and os.path.isfile(os.path.join(folder, n, ".metadata"))]
    return max(steps, default=None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--folder", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--plain-dcp", action="store_true")
    ap.add_argument("--hold-after", type=int, default=0,
                    help="after saving this step, wait until the file --release exists (a test's window)")
    ap.add_argument("--release", default="")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(args)
    if args.plain_dcp:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)   # stateless: the model and the step are all
        start = 0
        found = newest_complete(args.folder)
        if found is not None:
            state = {"model": model.state_dict(), "step": torch.tensor(0)}
            dcp.load(state, checkpoint_id=os.path.join(args.folder, f"step-{found}"))
            model.load_state_dict(state["model"])
            start = int(state["step"])
    else:
        opt, schedulers, train_state, manager = titan_parts(args, model)
        manager.load()   # the latest step-N holding .metadata, as torchtitan's trainer does
        start = train_state.step
    if start and rank == 0:
        print(f"resumed from step {start}", flush=True)
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(8, 16, generator=g)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():   # the data-parallel average, by hand (DDP's result, deterministic)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        done = step + 1
        if args.plain_dcp:
            if done % args.every == 0:
                folder = os.path.join(args.folder, f"step-{done}")
                dcp.save({"model": model.state_dict(), "step": torch.tensor(done)}, checkpoint_id=folder)
        else:
            schedulers.step()
            train_state.step = done
            manager.save(done, last_step=False)
        if rank == 0:
            print(f"step: {done} loss: {loss.item():.5f}", flush=True)
        time.sleep(args.step_s)
        while done == args.hold_after and not os.path.exists(args.release):
            time.sleep(0.05)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    if not args.plain_dcp:
        manager.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
