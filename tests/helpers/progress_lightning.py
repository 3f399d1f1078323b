"""A Lightning script as people run it: no ckptsup import, Lightning's default progress bar (its
TQDMProgressBar; --bar rich: RichProgressBar), validation every few steps, CPU, DDP under torchrun
(gloo). tests/test_progress_frameworks.py runs it under `ckptsup launch` at the defaults;
tests/test_progress_lines.py holds lines it printed.

    torchrun --nproc-per-node 2 progress_lightning.py --out DIR [--epochs 2] [--samples 48]
        [--step-s 0.2] [--val-every N] [--bar tqdm|rich|default] [--hang-file F]

--hang-file F: once F exists, rank 1 sleeps forever inside a training step, once per DIR (DIR/hung
marks it): a hang that is no stopped process, only silence.
"""

import argparse
import faulthandler
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.args.step_s:
            time.sleep(self.args.step_s)
        hung = Path(self.args.out) / "hung"
        if self.args.hang_file and self.global_rank == 1 and Path(self.args.hang_file).exists() and not hung.exists():
            hung.touch()
            time.sleep(10**6)   # stuck in the step: the other rank waits in DDP's all-reduce
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def data(n: int, batch: int) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.0)
    ap.add_argument("--val-every", type=int, default=0, help="validate every N training batches (0: each epoch)")
    ap.add_argument("--bar", choices=("tqdm", "rich", "default"), default="tqdm")
    ap.add_argument("--hang-file", default=None)
    args = ap.parse_args()
    faulthandler.register(signal.SIGUSR2)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    pl.seed_everything(7)
    callbacks = []
    if args.bar == "tqdm":
        from lightning.pytorch.callbacks import TQDMProgressBar
        callbacks.append(TQDMProgressBar())
    elif args.bar == "rich":
        from lightning.pytorch.callbacks import RichProgressBar
        callbacks.append(RichProgressBar())
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", devices=local, num_nodes=world // local,
                         strategy="ddp" if world > 1 else "auto", max_epochs=args.epochs, callbacks=callbacks,
                         enable_checkpointing=False, logger=False, enable_model_summary=False,
                         val_check_interval=args.val_every or None, limit_val_batches=3)
    trainer.fit(Net(args), train_dataloaders=data(args.samples, args.batch),
                val_dataloaders=data(args.samples, args.batch))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
