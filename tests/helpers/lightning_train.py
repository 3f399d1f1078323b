"""A Lightning script as users write it, with ckptsup's callback (tests/test_integration_lightning*.py,
bench/bench_lightning.py). 2 ranks of DDP on CPU (gloo) under torchrun or `ckptsup launch`.

    torchrun --nproc-per-node 2 lightning_train.py --out DIR [--epochs 2] [--samples 192] [--batch 4]
        [--step-s 0.05] [--mode ckptsup|plain|lightning-ckpt] [--every 5] [--ckpt-dir D] [--workers 0]
        [--no-distributed-sampler]

The model has dropout (the RNG matters) and a decaying LR (the scheduler matters). Every rank
appends one JSON line per batch to DIR/samples_rank<r>.jsonl: {"step": global step, "ids": the
sample ids, "t": wall time at the batch's start} (a resumed run rewrites the steps after its checkpoint; the last line of a step wins),
and at the end writes DIR/final_rank<r>.pt (the parameters). Rank 0 prints `step N loss X`.

--mode plain: no callback, no checkpoints (the overhead baseline); lightning-ckpt: Lightning's
own resume, ModelCheckpoint every --every steps and fit(ckpt_path="last") (the restart baseline).
"""
import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


class Ids(Dataset):
    """Sample i is (its id, a fixed input, a fixed target)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return torch.tensor(i), self.x[i], self.y[i]


class Net(pl.LightningModule):
    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))
        self.log_file = None

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        if self.log_file is None:
            self.log_file = open(os.path.join(self.args.out, f"samples_rank{self.global_rank}.jsonl"), "a")
        self.log_file.write(json.dumps({"step": self.global_step, "ids": ids.tolist(), "t": time.time()}) + "\n")
        self.log_file.flush()
        if self.args.step_s:
            time.sleep(self.args.step_s)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == 0:
            print(f"step {self.global_step} loss {loss.item():.6f}", flush=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(Ids(self.args.samples), batch_size=self.args.batch, shuffle=True,
                          num_workers=self.args.workers)


CALLBACK_S = [0.0]   # --time-callback: seconds inside the callback's per-step hook so far (rank 0)


def time_callback(callback) -> None:
    """Time the callback's per-step entry point in place (the benchmark's same-run figure)."""
    inner = callback.on_train_batch_end

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            CALLBACK_S[0] += time.perf_counter() - t0

    callback.on_train_batch_end = timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--mode", choices=("ckptsup", "plain", "lightning-ckpt"), default="ckptsup")
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--no-distributed-sampler", action="store_true")
    ap.add_argument("--time-callback", action="store_true", help="the benchmark: time spent inside the callback's per-step hook")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pl.seed_everything(7, workers=True)

    callbacks, ckpt_path = [], None
    if args.mode == "ckptsup":
        from ckptsup.integrations.lightning import CkptsupCallback

        callbacks.append(CkptsupCallback(save_every_steps=args.every, checkpoint_dir=args.ckpt_dir))
        if args.time_callback:
            time_callback(callbacks[-1])
    elif args.mode == "lightning-ckpt":
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every, save_top_k=-1,
                                         save_last=True))
        ckpt_path = "last"
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", devices=local, num_nodes=world // local,
                         strategy="ddp" if world > 1 else "auto",
                         max_epochs=args.epochs, callbacks=callbacks,
                         enable_checkpointing=args.mode == "lightning-ckpt", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         use_distributed_sampler=not args.no_distributed_sampler, deterministic=True)
    model = Net(args)
    trainer.fit(model, ckpt_path=ckpt_path)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(args.out, f"final_rank{trainer.global_rank}.pt"))
    if trainer.global_rank == 0:
        print(f"done at step {trainer.global_step}", flush=True)
        if args.time_callback:
            with open(os.path.join(args.out, "callback_s.json"), "w") as fh:
                json.dump({"callback_s": CALLBACK_S[0], "steps": trainer.global_step}, fh)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()   # gloo groups freed at interpreter exit can abort it


if __name__ == "__main__":
    main()
