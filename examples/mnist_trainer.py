"""The walk-through's last step: the same MNIST network trained by Transformers' ``Trainer`` on hasten.

A ``Trainer`` subclass with its own ``compute_loss``, a dict collate function, and
``notebook_launcher(train_trainer_ddp, args=(), num_processes=2)`` -- the code of the walk-through,
unchanged except for one line: ``hasten.install_as_accelerate()``, so that Transformers' own
``import accelerate`` gives hasten (``hasten launch`` and ``notebook_launcher`` do it for you in every
worker when Accelerate is not installed; a notebook that imports transformers first must call it itself).

    python examples/mnist_trainer.py                      # two processes, from a plain script or a notebook
    python examples/mnist_trainer.py --train_size 512     # a quick run
"""

from __future__ import annotations

import argparse
import math

import hasten

hasten.install_as_accelerate()  # before transformers is imported: its `import accelerate` gives hasten

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hasten import notebook_launcher  # noqa: E402

try:
    from mnist_digits import BasicNet, load_digits
except ImportError:  # run from the repository root
    from examples.mnist_digits import BasicNet, load_digits


class DigitsDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each sample as the dict a Trainer expects: ``{"x": image, "labels": label}``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.images[index], "labels": self.labels[index]}


def collate_fn(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([e["x"] for e in examples]), "labels": torch.stack([e["labels"] for e in examples])}


class MyTrainer(Trainer):
    """The walk-through's Trainer: the model returns log-probabilities, the loss is computed here."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        outputs = model(inputs["x"])
        loss = F.nll_loss(outputs, inputs["labels"])
        return (loss, outputs) if return_outputs else loss


def train_trainer_ddp(train_size: int = 4000, epochs: int = 1, output_dir: str = "mnist_trainer") -> None:
    """The function ``notebook_launcher`` starts on every process."""
    train, test = load_digits()
    train_set = DigitsDataset(*(t[:train_size] for t in train.tensors))
    test_set = DigitsDataset(*(t[: max(64, train_size // 4)] for t in test.tensors))
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=64, eval_strategy="epoch",
                             remove_unused_columns=False, label_names=["labels"], num_train_epochs=epochs,
                             learning_rate=1e-3,
                             report_to=[], logging_steps=1, save_strategy="no", seed=42, use_cpu=True)
    trainer = MyTrainer(BasicNet(), args, train_dataset=train_set, eval_dataset=test_set, data_collator=collate_fn)
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.accelerator.is_main_process:
        steps = math.ceil(train_size / (64 * trainer.accelerator.num_processes)) * epochs
        print(f"processes={trainer.accelerator.num_processes} steps={trainer.state.global_step}/{steps} "
              f"eval_loss={metrics['eval_loss']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train_size", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--num_processes", type=int, default=2)
    args = parser.parse_args()
    notebook_launcher(train_trainer_ddp, args=(args.train_size, args.epochs), num_processes=args.num_processes)


if __name__ == "__main__":
    main()
