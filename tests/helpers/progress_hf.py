"""A Hugging Face Trainer script as people run it: no ckptsup import, no callback of its own, the
Trainer's default progress output (its tqdm bar on stderr, its log dicts on stdout). A tiny model
built from its config (no download), CPU, DDP under torchrun (gloo). tests/test_progress_frameworks.py
runs it under `ckptsup launch` at the defaults; tests/test_progress_lines.py holds lines it printed.

    torchrun --nproc-per-node 2 progress_hf.py --out DIR [--epochs 2] [--samples 64] [--step-s 0.2]
        [--eval-steps N] [--no-tqdm] [--hang-file F]

--hang-file F: once F exists, rank 1 sleeps forever inside a training step, once per DIR (DIR/hung
marks it): a hang that is no stopped process, only silence. --no-tqdm: disable_tqdm=True (the
Trainer then prints only its log dicts).
"""

import argparse
import faulthandler
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments


class TinyConfig(PretrainedConfig):
    model_type = "progress-tiny-mlp"

    def __init__(self, dim: int = 8, hidden: int = 16, **kwargs):
        self.dim, self.hidden = dim, hidden
        super().__init__(**kwargs)


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig, args=None):
        super().__init__(config)
        self.net = nn.Sequential(nn.Linear(config.dim, config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1))
        self.args = args
        self.post_init()

    def _init_weights(self, module):
        pass

    def forward(self, x, labels):
        args = self.args
        if self.training and args is not None:
            if args.step_s:
                time.sleep(args.step_s)
            hung = Path(args.out) / "hung"
            if args.hang_file and os.environ.get("RANK") == "1" and Path(args.hang_file).exists() \
                    and not hung.exists():
                hung.touch()
                time.sleep(10**6)   # stuck in the step: the other rank waits in DDP's all-reduce
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, size: int, dim: int = 8):
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, dim, generator=gen)
        self.y = self.x @ torch.randn(dim, 1, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.0)
    ap.add_argument("--logging-steps", type=int, default=2)
    ap.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
    ap.add_argument("--no-tqdm", action="store_true")
    ap.add_argument("--hang-file", default=None)
    args = ap.parse_args()
    faulthandler.register(signal.SIGUSR2)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    targs = TrainingArguments(
        output_dir=str(Path(args.out) / "hf"), num_train_epochs=args.epochs, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, learning_rate=1e-2, logging_steps=args.logging_steps,
        eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
        save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True if args.no_tqdm else None)
    trainer = Trainer(model=TinyModel(TinyConfig(), args), args=targs, train_dataset=Synthetic(args.samples),
                      eval_dataset=Synthetic(args.samples // 2) if args.eval_steps else None)
    trainer.train()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
