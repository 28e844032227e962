"""Pipeline parallelism on transformers models other than causal LMs (forked gloo ranks): a sequence classifier
split by its base model's plan, its ``score`` head on the last stage, trained and evaluated with labels in the
ordinary loop, gives one process's gradients, losses and logits (right-padded rows: the head pools at each row's
last token, which it finds from the ``input_ids`` handed along the stages)."""

from __future__ import annotations

import pytest
import torch

from hasten.testing import run_on_ranks

pytest.importorskip("transformers")

BATCH, SEQ, STEPS = 4, 6, 2


def _classifier(num_labels: int):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                         num_labels=num_labels, attn_implementation="eager")
    return LlamaForSequenceClassification(config)


def _batches(num_labels: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded rows of different lengths; class labels, or one float target per row (regression)."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS + 1):
        ids = torch.randint(1, 48, (BATCH, SEQ), generator=generator)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        for row, pad in enumerate([0, 3, 1, 4]):
            if pad:
                mask[row, -pad:] = 0
        ids = ids.masked_fill(mask == 0, 0)
        labels = (torch.randint(0, num_labels, (BATCH,), generator=generator) if num_labels > 1 else
                  torch.randn(BATCH, generator=generator))
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def _train_and_evaluate(num_labels: int, num_items: bool, pipelined: bool):
    """Two AdamW steps (with ``num_items_in_batch`` as Trainer passes it, when asked), then an evaluation with
    labels; the first step's gradients, the losses, the evaluation's logits."""
    model = _classifier(num_labels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    accelerator = None
    if pipelined:
        from hasten import Accelerator, ParallelismConfig

        world = torch.distributed.get_world_size()
        config = ParallelismConfig(pp_size=world, pp_microbatches=2 if world == 2 else 4)
        accelerator = Accelerator(parallelism_config=config, cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)
    *train, evaluation = _batches(num_labels)
    grads, losses = {}, []
    for step, batch in enumerate(train):
        extra = {"num_items_in_batch": torch.tensor(BATCH)} if num_items else {}
        loss = model(**batch, **extra).loss
        accelerator.backward(loss) if accelerator else loss.backward()
        if step == 0:
            named = (accelerator.unwrap_model(model) if accelerator else model).named_parameters()
            grads = {name: p.grad.clone() for name, p in named if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        outputs = model(**evaluation)
    return grads, losses + [outputs.loss.item()], outputs.logits


@pytest.mark.parametrize("num_labels, num_items, world", [(3, True, 2), (1, True, 2), (3, False, 3)])
def test_sequence_classifier_trains_and_evaluates_with_its_own_loss_as_one_process(num_labels, num_items, world):
    """Single-label (its loss divides by ``num_items_in_batch``) and regression (a mean that ignores it) heads;
    2 and 3 stages: gradients and logits within 1e-6, the losses (training and evaluation) within 1e-6 relative."""
    want_grads, want_losses, want_logits = _train_and_evaluate(num_labels, num_items, pipelined=False)
    results = run_on_ranks(_train_and_evaluate, world_size=world, args=(num_labels, num_items, True))
    seen = {}
    for grads, losses, logits in results:
        assert losses == pytest.approx(want_losses, rel=1e-6)  # on every stage
        assert torch.allclose(logits, want_logits, rtol=0, atol=1e-6)  # sent from the last stage
        for name, grad in grads.items():
            assert torch.allclose(grad, want_grads[name], rtol=0, atol=1e-6), name
            seen[name] = grad
    assert set(seen) == set(want_grads) and "score.weight" in seen
