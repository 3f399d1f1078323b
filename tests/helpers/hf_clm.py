"""A causal-LM fine-tuning script in the shape of transformers' examples/pytorch/language-modeling/
run_clm.py (written here, not copied): HfArgumentParser over ModelArguments / DataTrainingArguments /
TrainingArguments, a text file through `datasets.load_dataset("text", ...)`, tokenize + group_texts,
a model from a config (a tiny GPT-2, built locally: no download), the Trainer, and the resume
run_clm does by itself: `get_last_checkpoint(output_dir)` when the folder holds a checkpoint-N.
No ckptsup import, no callback of ckptsup's. tests/test_hf_dropin_*.py run it under `ckptsup launch`.

    torchrun --nproc-per-node 2 hf_clm.py --train_file T.txt --output_dir OUT --do_train
        --max_steps 16 --save_steps 4 --per_device_train_batch_size 2 --block_size 16 --cache_dir C

The tokenizer is a word-level one built from the train file (run_clm loads a pretrained one).
Faults for the tests, from the environment (test-only, none by default):
  HF_CLM_STEP_S=S      each training step sleeps S seconds (so a test can act mid-run)
  HF_CLM_MARKS=DIR     where the faults below mark that they happened (each happens once)
  HF_CLM_TEAR_AT=N     rank 0, saving checkpoint-N: after optimizer.pt is written it truncates it
                       to half and SIGKILLs itself (a death mid-save: no rng state, no trainer_state.json)
  HF_CLM_HANG_FILE=F   once F exists, rank 1 sleeps forever inside a training step
"""

import faulthandler
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    n_embd: int = field(default=16, metadata={"help": "the tiny GPT-2's width"})
    n_layer: int = field(default=1, metadata={"help": "its layers"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "where datasets keeps its cache"})


@dataclass
class DataTrainingArguments:
    train_file: Optional[str] = field(default=None, metadata={"help": "a text file, one example a line"})
    block_size: Optional[int] = field(default=16, metadata={"help": "tokens per training example"})
    max_train_samples: Optional[int] = field(default=None)


class TestFaults(TrainerCallback):
    """The environment's faults (see the module's docstring)."""

    def __init__(self, marks: Path) -> None:
        self.step_s = float(os.environ.get("HF_CLM_STEP_S", "0") or 0)
        self.hang_file = os.environ.get("HF_CLM_HANG_FILE")
        self.marks = marks

    def on_step_begin(self, args, state, control, **kwargs):
        if self.step_s:
            time.sleep(self.step_s)
        if self.hang_file and os.environ.get("RANK") == "1" and Path(self.hang_file).exists() \
                and not (self.marks / "hung").exists():
            (self.marks / "hung").touch()
            time.sleep(10**6)   # stuck in the step: rank 0 waits in DDP's all-reduce


def tear_mid_save(trainer: Trainer, step: int, marks: Path) -> None:
    """Rank 0 dies saving checkpoint-`step`, once: optimizer.pt half written, nothing after it."""
    original = trainer._save_optimizer_and_scheduler

    def save(output_dir):
        original(output_dir)
        if trainer.state.global_step == step and trainer.args.process_index == 0 and not (marks / "torn").exists():
            (marks / "torn").touch()
            path = Path(output_dir) / "optimizer.pt"
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

    trainer._save_optimizer_and_scheduler = save


def word_tokenizer(train_file: str) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for line in Path(train_file).read_text().splitlines() for w in line.split()})
    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")


def main() -> None:
    faulthandler.register(signal.SIGUSR2)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        datefmt="%m/%d/%Y %H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)

    # Detecting last checkpoint (as run_clm does).
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)

    raw_datasets = datasets.load_dataset("text", data_files={"train": data_args.train_file},
                                         cache_dir=model_args.cache_dir)
    tokenizer = word_tokenizer(data_args.train_file)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=model_args.n_embd,
                        n_layer=model_args.n_layer, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config)

    column_names = list(raw_datasets["train"].features)
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized_datasets = raw_datasets.map(tokenize_function, batched=True, remove_columns=column_names,
                                              desc="Running tokenizer on dataset")

    block_size = data_args.block_size

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized_datasets.map(group_texts, batched=True, desc=f"Grouping texts in chunks of {block_size}")

    train_dataset = lm_datasets["train"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))

    marks = Path(os.environ.get("HF_CLM_MARKS") or training_args.output_dir)
    marks.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, processing_class=tokenizer,
                      data_collator=default_data_collator, callbacks=[TestFaults(marks)])
    if os.environ.get("HF_CLM_TEAR_AT"):
        tear_mid_save(trainer, int(os.environ["HF_CLM_TEAR_AT"]), marks)

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()


if __name__ == "__main__":
    main()
