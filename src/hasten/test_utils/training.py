"""Accelerate's ``accelerate.test_utils.training`` loaders for its example scripts' test mode.

Accelerate's versions tokenize a few bundled MRPC rows with a downloaded tokenizer; hasten's build
tensors of the same shapes from a fixed seed, so an example's training loop runs offline.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from hasten._lazy import accelerate_path_getattr
from hasten.testing.accelerate_compat import RegressionDataset, RegressionModel

__all__ = ["RegressionDataset", "RegressionModel", "mocked_dataloaders", "mocked_dataloaders_for_autoregressive_models"]

_VOCAB = (1000, 2000)  # token ids in an ordinary-word range of BERT-sized vocabularies
_SEQ_LEN = 32


class _TokenizedPairs(Dataset):  # type: ignore[type-arg]
    def __init__(self, length: int, seed: int, autoregressive: bool) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(*_VOCAB, (length, _SEQ_LEN), generator=generator)
        self.labels = torch.randint(0, 2, (length,), generator=generator)
        self.autoregressive = autoregressive

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[index]
        item = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.autoregressive:
            item["labels"] = ids.clone()
        else:
            item["token_type_ids"] = (torch.arange(_SEQ_LEN) >= _SEQ_LEN // 2).long()
            item["labels"] = self.labels[index]
        return item


def mocked_dataloaders(accelerator: Any, batch_size: int = 16) -> tuple[DataLoader, DataLoader]:  # type: ignore[type-arg]
    """Train (64 rows, shuffled) and eval (32 rows) loaders of sentence-pair classification batches:
    ``input_ids``, ``attention_mask``, ``token_type_ids``, ``labels``."""
    train = DataLoader(_TokenizedPairs(64, 0, False), shuffle=True, batch_size=batch_size)
    evaluation = DataLoader(_TokenizedPairs(32, 1, False), shuffle=False, batch_size=batch_size)
    return train, evaluation


def mocked_dataloaders_for_autoregressive_models(accelerator: Any,
                                                 batch_size: int = 16) -> tuple[DataLoader, DataLoader]:  # type: ignore[type-arg]
    """Like :func:`mocked_dataloaders`, for causal language models (``labels`` are the ``input_ids``)."""
    train = DataLoader(_TokenizedPairs(64, 0, True), shuffle=True, batch_size=batch_size)
    evaluation = DataLoader(_TokenizedPairs(32, 1, True), shuffle=False, batch_size=batch_size)
    return train, evaluation

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
