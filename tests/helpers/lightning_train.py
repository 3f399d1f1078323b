"""A Lightning script as users write it, with ckptsup's callback (tests/test_integration_lightning*.py,
bench/bench_lightning.py). 2 ranks of DDP on CPU (gloo) under torchrun or `ckptsup launch`.

    torchrun --nproc-per-node 2 lightning_train.py --out DIR [--epochs 2] [--samples 192] [--batch 4]
        [--step-s 0.05] [--mode ckptsup|plain|lightning-ckpt] [--every 5] [--ckpt-dir D] [--workers 0]
        [--no-distributed-sampler] [--stateful] [--model-checkpoint] [--ckpt-path last] [--die-at N]

The model has dropout (the RNG matters) and a decaying LR (the scheduler matters). Every rank
appends one JSON line per batch to DIR/samples_rank<r>.jsonl: {"step": global step, "ids": the
sample ids, "t": wall time at the batch's start} (a resumed run rewrites the steps after its checkpoint; the last line of a step wins),
and at the end writes DIR/final_rank<r>.pt (the parameters). Rank 0 prints `step N loss X`.

--stateful: the data come from a DataModule with a state_dict (samples seen), a callback with a
state_dict (batches counted) goes before ckptsup's, and the LightningModule adds a key of its own in
on_save_checkpoint (steps counted); each rank writes DIR/state_rank<r>.json with the three at the end.
--model-checkpoint: Lightning's own ModelCheckpoint (every --pl-every steps, all kept, last.ckpt, into --ckpt-dir/pl)
beside ckptsup's callback (enable_checkpointing stays on); --ckpt-path: fit(ckpt_path=...).
--die-at N: rank 1 SIGKILLs itself at global step N when DIR/died does not exist yet (it creates it).

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


class IdsData(pl.LightningDataModule):
    """The same loader as Net.train_dataloader, with a state: the samples this rank has trained on."""

    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        self.seen = 0

    def train_dataloader(self):
        return DataLoader(Ids(self.args.samples), batch_size=self.args.batch, shuffle=True,
                          num_workers=self.args.workers)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state) -> None:
        self.seen = state["seen"]


class Counting(pl.Callback):
    """A stateful callback (Lightning's Callback.state_dict / state_key)."""

    def __init__(self) -> None:
        self.batches = 0

    @property
    def state_key(self) -> str:
        return "Counting[test]"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state) -> None:
        self.batches = state["batches"]


class Net(pl.LightningModule):
    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))
        self.log_file = None
        self.steps_seen = 0   # --stateful: kept through on_save_checkpoint / on_load_checkpoint

    def on_save_checkpoint(self, checkpoint) -> None:
        checkpoint["net_extra"] = {"steps_seen": self.steps_seen}

    def on_load_checkpoint(self, checkpoint) -> None:
        if "net_extra" in checkpoint:
            self.steps_seen = checkpoint["net_extra"]["steps_seen"]

    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        self.steps_seen += 1
        if self.trainer.datamodule is not None:
            self.trainer.datamodule.seen += len(ids)
        if self.global_step == self.args.die_at and self.global_rank == 1:
            marker = os.path.join(self.args.out, "died")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), 9)
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
    ap.add_argument("--stateful", action="store_true")
    ap.add_argument("--model-checkpoint", action="store_true")
    ap.add_argument("--ckpt-path", default=None)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--pl-every", type=int, default=5, help="--model-checkpoint: its every_n_train_steps")
    ap.add_argument("--time-callback", action="store_true", help="the benchmark: time spent inside the callback's per-step hook")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pl.seed_everything(7, workers=True)

    callbacks, ckpt_path = [], args.ckpt_path
    counting = Counting() if args.stateful else None
    if counting is not None:
        callbacks.append(counting)   # before ckptsup's: its count of a step is in that step's checkpoint
    if args.model_checkpoint:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=os.path.join(args.ckpt_dir, "pl"), every_n_train_steps=args.pl_every,
                                         save_top_k=-1, save_last=True, filename="{epoch}-{step}"))
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
                         enable_checkpointing=args.mode == "lightning-ckpt" or args.model_checkpoint, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         use_distributed_sampler=not args.no_distributed_sampler, deterministic=True)
    model = Net(args)
    datamodule = IdsData(args) if args.stateful else None
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    if args.stateful:
        with open(os.path.join(args.out, f"state_rank{trainer.global_rank}.json"), "w") as fh:
            json.dump({"datamodule_seen": datamodule.seen, "callback_batches": counting.batches,
                       "module_steps_seen": model.steps_seen, "global_step": trainer.global_step}, fh)
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
