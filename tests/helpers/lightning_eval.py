"""A Lightning script whose validation pass is long and quiet (tests/test_phase_local.py): 2 DDP
ranks on CPU (gloo) with ckptsup's callback; every --val-every training batches a validation pass
of --val-batches batches of --val-batch-s seconds each (sleep in validation_step), nothing printed.

    ckptsup launch --nproc-per-node 2 lightning_eval.py --out DIR [--steps 30] [--val-every 20]
        [--val-batches 8] [--val-batch-s 5]

Rank 0 prints `step N` per training batch and, at the end, writes DIR/done.json
{"steps", "validations"}.
"""
import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ckptsup.integrations.lightning import CkptsupCallback


class Net(pl.LightningModule):
    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Linear(8, 1)
        self.validations = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        time.sleep(0.05)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == 0:
            print(f"step {self.global_step} loss {loss.item():.6f}", flush=True)
        return loss

    def validation_step(self, batch, batch_idx):
        time.sleep(self.args.val_batch_s)   # a slow evaluation batch, no output
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_validation_end(self):
        self.validations += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def _data(self, n: int):
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))

    def train_dataloader(self):
        return DataLoader(self._data(self.args.steps * 4 * 2), batch_size=4)

    def val_dataloader(self):
        return DataLoader(self._data(self.args.val_batches * 2), batch_size=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--val-every", type=int, default=20)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--val-batch-s", type=float, default=5.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pl.seed_everything(7)
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", devices=local, num_nodes=world // local,
                         strategy="ddp" if world > 1 else "auto", max_epochs=1, max_steps=args.steps,
                         val_check_interval=args.val_every, check_val_every_n_epoch=None,
                         callbacks=[CkptsupCallback(save_every_steps=10)], enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    model = Net(args)
    trainer.fit(model)
    if trainer.global_rank == 0:
        with open(os.path.join(args.out, "done.json"), "w") as fh:
            json.dump({"steps": trainer.global_step, "validations": model.validations}, fh)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
