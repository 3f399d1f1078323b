"""A Hugging Face Trainer run whose evaluate() is long and quiet (tests/test_phase_local.py): a
tiny PreTrainedModel (no download), 2 DDP ranks on CPU (gloo) with ckptsup's callback,
eval_strategy="steps": every --eval-every steps an evaluation of --eval-batches batches of
--eval-batch-s seconds each (a sleep in forward while not training), nothing printed.

    ckptsup launch --nproc-per-node 2 hf_eval.py --out DIR [--steps 16] [--eval-every 10]
        [--eval-batches 8] [--eval-batch-s 5]

Rank 0 writes DIR/done.json {"steps", "evaluations"} at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from ckptsup.integrations.hf import CkptsupCallback, resume_path


class TinyConfig(PretrainedConfig):
    model_type = "ckptsup-tiny-eval"

    def __init__(self, dim: int = 8, eval_batch_s: float = 0.0, **kwargs):
        self.dim, self.eval_batch_s = dim, eval_batch_s
        super().__init__(**kwargs)


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig):
        super().__init__(config)
        self.net = nn.Linear(config.dim, 1)
        self.post_init()

    def _init_weights(self, module):
        pass

    def forward(self, x, labels):
        if not self.training:
            time.sleep(self.config.eval_batch_s)   # a slow evaluation batch
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


class Data(torch.utils.data.Dataset):
    def __init__(self, size: int):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, 8, generator=g), torch.randn(size, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Count(TrainerCallback):
    def __init__(self):
        self.evaluations = 0

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluations += 1

    def on_step_end(self, args, state, control, **kwargs):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"hf step {state.global_step - 1} done", flush=True)
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--eval-batch-s", type=float, default=5.0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = TinyModel(TinyConfig(eval_batch_s=args.eval_batch_s))
    targs = TrainingArguments(
        output_dir=str(out / "hf"), max_steps=args.steps, per_device_train_batch_size=4,
        per_device_eval_batch_size=1, eval_strategy="steps", eval_steps=args.eval_every, save_strategy="no",
        learning_rate=1e-2, report_to=[], disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
        logging_steps=5, ddp_find_unused_parameters=False, seed=0)
    count = Count()
    trainer = Trainer(model=model, args=targs, train_dataset=Data(args.steps * 8), eval_dataset=Data(args.eval_batches * 2),
                      callbacks=[count, CkptsupCallback(save_every_steps=10)])
    trainer.train(resume_from_checkpoint=resume_path(trainer))
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "done.json").write_text(json.dumps({"steps": trainer.state.global_step, "evaluations": count.evaluations}))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
