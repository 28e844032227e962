"""Pipeline parallelism on a transformers model split by its ``base_model_pp_plan`` (forked gloo ranks): the
ordinary loop (``outputs = model(**batch)``, ``accelerator.backward(outputs.loss)``) gives one process's
gradients and losses, with padding spread unevenly over the micro-batches, and weights tied across the first
and last stage stay tied."""

from __future__ import annotations

import pytest
import torch

from hasten.testing import run_on_ranks

pytest.importorskip("transformers")

LAYERS, BATCH, SEQ, STEPS = 4, 4, 6, 2


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=tied, attn_implementation="eager")
    return LlamaForCausalLM(config)


def _batches() -> list[dict[str, torch.Tensor]]:
    """Left-padded batches whose padding differs per row (so per micro-batch token counts differ)."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(1, 48, (BATCH, SEQ), generator=generator)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        for row, pad in enumerate([0, 3, 1, 4]):
            mask[row, :pad] = 0
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def _reference(tied: bool):
    model = _llama(tied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    grads, losses = {}, []
    for step, batch in enumerate(_batches()):
        loss = model(**batch).loss
        loss.backward()
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters(remove_duplicate=False)}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {name: p.detach().clone() for name, p in model.state_dict(keep_vars=True).items()}
    return grads, losses, weights


def _pipelined(tied: bool, microbatches: int, split_points: list[str] | None):
    from hasten import Accelerator, ParallelismConfig

    model = _llama(tied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    world = torch.distributed.get_world_size()
    config = ParallelismConfig(pp_size=world, pp_microbatches=microbatches, pp_split_points=split_points)
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    grads, losses = {}, []
    for step, batch in enumerate(_batches()):
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        if step == 0:
            unwrapped = accelerator.unwrap_model(model)
            grads = {name: p.grad.clone() for name, p in unwrapped.named_parameters(remove_duplicate=False)}
        accelerator.clip_grad_norm_(model.parameters(), 1e-3)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(outputs.loss.item())
    weights = {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).state_dict().items()}
    return grads, losses, weights, type(outputs).__name__


def _check(results, want_grads, want_losses, want_weights) -> None:
    seen_grads, seen_weights = {}, {}
    for grads, losses, weights, output_type in results:
        assert output_type == "CausalLMOutputWithPast"
        assert losses == pytest.approx(want_losses, rel=1e-6)  # the loss on every stage
        for name, grad in grads.items():
            assert torch.allclose(grad, want_grads[name], rtol=0, atol=1e-6), name
            seen_grads[name] = grad
        for name, weight in weights.items():  # full-model names; a tied weight equal on both stages
            assert torch.allclose(weight, want_weights[name], rtol=0, atol=1e-6), name
            seen_weights[name] = weight
    assert set(seen_grads) == set(want_grads) and set(seen_weights) == set(want_weights)


@pytest.mark.parametrize("world, microbatches, points", [(2, 2, None), (2, 4, None), (3, 4, ["model.layers.1",
                                                                                              "model.layers.3"])])
def test_llama_split_by_its_plan_equals_one_process(world, microbatches, points):
    want = _reference(tied=False)
    _check(run_on_ranks(_pipelined, world_size=world, args=(False, microbatches, points)), *want)


def test_tied_embeddings_across_stages_stay_tied_and_equal_one_process():
    want = _reference(tied=True)
    results = run_on_ranks(_pipelined, world_size=2, args=(True, 2, None))
    _check(results, *want)
    first, last = results[0], results[-1]
    assert torch.equal(first[0]["model.embed_tokens.weight"], last[0]["lm_head.weight"])  # summed, the same
    assert torch.equal(first[2]["model.embed_tokens.weight"], last[2]["lm_head.weight"])
