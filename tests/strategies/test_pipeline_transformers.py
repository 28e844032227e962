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
    model.eval()
    with torch.no_grad():
        losses += [model(**_batches()[0]).loss.item()] * 2
    return grads, losses, weights


def _pipelined(tied: bool, microbatches: int, split_points: list[str] | None, schedule: str = "1F1B",
               count_items: bool = False):
    """The reference loop under PP; ``count_items``: the call passes ``num_items_in_batch`` (Trainer's way)."""
    from hasten import Accelerator, ParallelismConfig

    model = _llama(tied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    world = torch.distributed.get_world_size()
    config = ParallelismConfig(pp_size=world, pp_microbatches=microbatches, pp_split_points=split_points,
                               pp_schedule=schedule)
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    grads, losses = {}, []
    for step, batch in enumerate(_batches()):
        extra = {"num_items_in_batch": (batch["labels"][:, 1:] != -100).sum()} if count_items else {}
        outputs = model(**batch, **extra)
        accelerator.backward(outputs.loss)
        if step == 0:
            unwrapped = accelerator.unwrap_model(model)
            grads = {name: p.grad.clone() for name, p in unwrapped.named_parameters(remove_duplicate=False)}
        accelerator.clip_grad_norm_(model.parameters(), 1e-3)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(outputs.loss.item())
    weights = {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).state_dict().items()}
    model.eval()
    with torch.no_grad():
        evaluated = model(**_batches()[0])
        unwrapped = accelerator.unwrap_model(model)(**_batches()[0])  # what Trainer evaluates with
    losses += [evaluated.loss.item(), unwrapped.loss.item()]  # evaluation with labels: the loss over the logits
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


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                      "DualPipeV"])
@pytest.mark.parametrize("tied", [False, True])
def test_llama_with_two_stages_per_process_equals_one_process(schedule, tied):
    """pp 2, 4 stages (one layer each) under the schedules that hold several stages per process: the model's own
    token-normalised loss (num_items_in_batch given), every gradient, the weights after two clipped steps and the
    evaluated loss as one process's, under the full model's names; a tied weight stays equal on its stages."""
    want = _reference(tied)
    results = run_on_ranks(_pipelined, world_size=2, args=(tied, 4, None, schedule, True))
    _check(results, *want)
    if tied:
        grads = {name: grad for result in results for name, grad in result[0].items()}
        assert torch.equal(grads["model.embed_tokens.weight"], grads["lm_head.weight"])


def test_tied_embeddings_across_stages_stay_tied_and_equal_one_process():
    want = _reference(tied=True)
    results = run_on_ranks(_pipelined, world_size=2, args=(True, 2, None))
    _check(results, *want)
    first, last = results[0], results[-1]
    assert torch.equal(first[0]["model.embed_tokens.weight"], last[0]["lm_head.weight"])  # summed, the same
    assert torch.equal(first[2]["model.embed_tokens.weight"], last[2]["lm_head.weight"])


def test_split_points_deal_out_layers_evenly_and_lighten_the_edge_stages_on_request():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hasten.strategies.pipeline_hf import cut_transformers_stage, transformers_split_points
    from hasten.strategies.pipeline_split import SkippedModule

    def llama():
        return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=8,
                                            num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False))

    assert transformers_split_points(llama(), 4) == ["model.layers.2", "model.layers.4", "model.layers.6"]
    assert transformers_split_points(llama(), 4, first_stage_less_layers=1, last_stage_less_layers=1) == [
        "model.layers.1", "model.layers.3", "model.layers.6"]
    full = set(llama().state_dict())
    kept = []
    for stage in range(3):
        model, _, tied = cut_transformers_stage(llama(), ["model.layers.3", "model.layers.6"], stage, 3)
        assert not tied
        assert not isinstance(model.model.rotary_emb, SkippedModule)  # outside the plan: on every stage
        kept.append(set(model.state_dict()))
    assert {"model.embed_tokens.weight", "model.layers.2.mlp.up_proj.weight"} <= kept[0]
    assert "model.layers.3.mlp.up_proj.weight" in kept[1] and "model.layers.6.mlp.up_proj.weight" not in kept[1]
    assert {"model.norm.weight", "lm_head.weight", "model.layers.7.mlp.up_proj.weight"} <= kept[2]
    assert kept[0] | kept[1] | kept[2] == full and not (kept[0] & kept[1] or kept[1] & kept[2])


def test_weights_outside_the_plan_and_unknown_split_points_are_refused():
    from hasten.exceptions import ConfigurationError
    from hasten.strategies.pipeline_hf import cut_transformers_stage

    model = _llama(tied=False)
    model.model.adapter = torch.nn.Linear(16, 16)
    with pytest.raises(ConfigurationError, match=r"weights outside its pipeline plan \(\['model.adapter.weight'"):
        cut_transformers_stage(model, None, 0, 2)
    with pytest.raises(ConfigurationError, match="needs 1 split points among its pipeline units"):
        cut_transformers_stage(_llama(tied=False), ["model.layers.1.mlp"], 0, 2)


def test_save_pretrained_of_one_stage_is_refused_and_works_with_the_full_weights(tmp_path):
    from hasten.exceptions import ConfigurationError
    from hasten.strategies.pipeline_hf import cut_transformers_stage

    full = _llama(tied=False).state_dict()
    stage, _, _ = cut_transformers_stage(_llama(tied=False), None, 0, 2)
    with pytest.raises(ConfigurationError, match="holds one pipeline stage"):
        stage.save_pretrained(tmp_path / "stage")
    assert not (tmp_path / "stage").exists()
    stage.save_pretrained(tmp_path / "full", state_dict=full)
    assert (tmp_path / "full" / "model.safetensors").is_file()


def _scaled_losses(factors: list[float]):
    """One window of micro-steps without zero_grad, backward of ``factor * outputs.loss`` for each factor."""
    from hasten import Accelerator, ParallelismConfig
    from hasten.exceptions import ConfigurationError

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_microbatches=2), cpu=True)
    model = accelerator.prepare(_llama(tied=True))
    try:
        for factor, batch in zip(factors, _batches()):
            accelerator.backward(model(**batch).loss * factor)
    except ConfigurationError as error:
        return str(error)
    return {name: p.grad.clone() for name, p in accelerator.unwrap_model(model).named_parameters()}


def test_a_loss_scaled_by_the_caller_scales_the_gradients_and_a_changed_scale_is_refused():
    model = _llama(tied=True)
    for factor, batch in zip([3.0, 3.0], _batches()):
        (model(**batch).loss * factor).backward()
    results = run_on_ranks(_scaled_losses, world_size=2, args=([3.0, 3.0],))
    for grads in results:
        for name, grad in grads.items():
            want = dict(model.named_parameters(remove_duplicate=False))[name].grad
            assert torch.allclose(grad, want, rtol=0, atol=1e-5), name
    refused = run_on_ranks(_scaled_losses, world_size=2, args=([3.0, 5.0],))
    assert all("scaled by 5 before accelerator.backward" in message for message in refused)


def _save_after_one_step(folder: str, schedule: str = "1F1B"):
    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, pp_microbatches=4, pp_schedule=schedule)
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _llama(tied=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(**_batches()[0]).loss)
    optimizer.step()
    optimizer.zero_grad()
    accelerator.save_state(folder)
    accelerator.save_model(model, folder + "-model")
    with torch.no_grad():  # moved off, so the load has something to restore
        for param in accelerator.unwrap_model(model).parameters():
            param.add_(1.0)
    accelerator.load_state(folder)
    return {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()}


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_tied_embeddings_save_state_writes_the_full_model_and_loads_back(tmp_path, schedule):
    """One checkpoint and one saved model with every key, from one or two stages per process."""
    from safetensors.torch import load_file

    model = _llama(tied=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(**_batches()[0]).loss.backward()
    optimizer.step()
    want = dict(model.named_parameters())
    results = run_on_ranks(_save_after_one_step, world_size=2, args=(str(tmp_path / "ckpt"), schedule))
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert set(want) <= set(saved)
    for name, weight in want.items():
        assert torch.allclose(saved[name], weight, rtol=0, atol=1e-6), name
    model_file = load_file(tmp_path / "ckpt-model" / "model.safetensors")
    assert set(model_file) == set(model.state_dict())
    for name, weight in model_file.items():
        assert torch.allclose(weight, model.state_dict()[name], rtol=0, atol=1e-6), name
    for stage_weights in results:  # loaded back onto each stage
        for name, weight in stage_weights.items():
            assert torch.allclose(weight, want[name], rtol=0, atol=1e-6), name


def _replica_half(batch: dict[str, torch.Tensor], replica: int) -> dict[str, torch.Tensor]:
    return {key: value[2 * replica:2 * replica + 2] for key, value in batch.items()}


def _pp_by_ddp_grads():
    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, dp_replicate_size=2, pp_microbatches=2)
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = accelerator.prepare(_llama(tied=True))
    replica = int(accelerator.torch_device_mesh.get_local_rank("dp_replicate"))
    accelerator.backward(model(**_replica_half(_batches()[0], replica)).loss)
    unwrapped = accelerator.unwrap_model(model)
    return {name: p.grad.clone() for name, p in unwrapped.named_parameters(remove_duplicate=False)}


def test_pp2_by_ddp2_with_tied_embeddings_equals_ddp():
    """Each replica's loss over its own tokens, averaged over the replicas, as DDP does."""
    model = _llama(tied=True)
    (sum(model(**_replica_half(_batches()[0], replica)).loss for replica in range(2)) / 2).backward()
    want = dict(model.named_parameters(remove_duplicate=False))
    for grads in run_on_ranks(_pp_by_ddp_grads, world_size=4):
        for name, grad in grads.items():
            assert torch.allclose(grad, want[name].grad, rtol=0, atol=1e-6), name



def _pp_by_fsdp2_grads(folder: str, schedule: str = "1F1B"):
    from hasten import Accelerator, ParallelismConfig
    from hasten.exceptions import ConfigurationError

    config = ParallelismConfig(pp_size=2, dp_shard_size=2, pp_microbatches=2, pp_schedule=schedule)
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = accelerator.prepare(_llama(tied=False))
    shard = int(accelerator.torch_device_mesh.get_local_rank("dp_shard"))
    accelerator.backward(model(**_replica_half(_batches()[0], shard)).loss)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:  # sharded stages: the main process cannot read the other stages alone
        with pytest.raises(ConfigurationError, match="not sharded"):
            unwrapped.save_pretrained(folder)
    return {name: p.grad.full_tensor().clone() for name, p in unwrapped.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pp2_by_fsdp2_of_a_transformers_model_equals_data_parallel(tmp_path, schedule):
    """The stage of a model cut by its plan (two of four per process under Interleaved1F1B) is sharded over
    dp_shard like any other stage: its gradients are the average of the two halves' losses, as data
    parallelism gives. save_pretrained() without a state_dict is refused there, on the main process too."""
    model = _llama(tied=False)
    (sum(model(**_replica_half(_batches()[0], half)).loss for half in range(2)) / 2).backward()
    want = dict(model.named_parameters())
    results = run_on_ranks(_pp_by_fsdp2_grads, world_size=4, args=(str(tmp_path / "refused"), schedule))
    for grads in results:
        for name, grad in grads.items():
            assert torch.allclose(grad, want[name].grad, rtol=0, atol=1e-6), name
    assert set().union(*results) == set(want) and not (tmp_path / "refused").exists()


def _prepare_message(tied: bool, config_kwargs: dict) -> str:
    """What ``prepare`` of the Llama under ``ParallelismConfig(**config_kwargs)`` raises (or "prepared")."""
    from hasten import Accelerator, ParallelismConfig

    accelerator = Accelerator(parallelism_config=ParallelismConfig(**config_kwargs), cpu=True)
    try:
        accelerator.prepare(_llama(tied=tied))
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return "prepared"


def test_tied_embeddings_under_pp_by_fsdp2_are_refused_at_prepare_with_the_fix():
    for message in run_on_ranks(_prepare_message, world_size=4,
                                args=(True, {"pp_size": 2, "dp_shard_size": 2, "pp_microbatches": 2})):
        assert message.startswith("ConfigurationError") and "tie_word_embeddings=False" in message


def test_several_stages_per_process_refuse_uneven_stages_and_a_forward_replaced_on_the_model():
    for message in run_on_ranks(_prepare_message, world_size=2, args=(False, {
            "pp_size": 2, "pp_schedule": "Interleaved1F1B", "pp_microbatches": 2,
            "pp_split_points": ["model.layers.1", "model.layers.2"]})):
        assert message.startswith("ConfigurationError") and "do not divide evenly over pp_size=2" in message
    from hasten.exceptions import ConfigurationError
    from hasten.strategies.pipeline_hf import cut_transformers_stages

    model = _llama(tied=False)
    model.forward = lambda **kwargs: None  # as a trainer patching its model might
    with pytest.raises(ConfigurationError, match="forward was replaced on the model object"):
        cut_transformers_stages(model, None, [0, 2], 4)


def _main_process_saves_alone(folder: str, replicas: int):
    """Train; after each step the main process alone writes ``save_pretrained`` without a state_dict and
    returns ``optimizer.state_dict()`` (as transformers' Trainer saves) while the other stages go on."""
    import copy

    from hasten import Accelerator, ParallelismConfig

    config = ParallelismConfig(pp_size=2, dp_replicate_size=replicas, pp_microbatches=2)
    accelerator = Accelerator(parallelism_config=config, cpu=True)
    model = _llama(tied=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    replica = int(accelerator.torch_device_mesh.get_local_rank("dp_replicate")) if replicas > 1 else 0
    states = []
    for step, batch in enumerate(_batches()):
        accelerator.backward(model(**(_replica_half(batch, replica) if replicas > 1 else batch)).loss)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(f"{folder}/step{step}")
            states.append(copy.deepcopy(optimizer.state_dict()))  # its tensors are the optimizer's own, as torch's
    return states


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_main_process_alone_saves_the_full_model_and_optimizer_as_one_process(tmp_path, replicas):
    """Under pp_size=2 (and PP x DDP) the main process alone writes the whole model with save_pretrained() and
    gets the whole model's optimizer.state_dict() in one process's format, each step's exactly (the other
    stages have already gone on to the next step): what transformers' Trainer checkpoints need."""
    import copy

    from safetensors.torch import load_file

    model = _llama(tied=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    want_states = []
    for step, batch in enumerate(_batches()):
        halves = [_replica_half(batch, r) for r in range(2)] if replicas > 1 else [batch]
        (sum(model(**half).loss for half in halves) / len(halves)).backward()
        optimizer.step()
        optimizer.zero_grad()
        model.save_pretrained(tmp_path / "one" / f"step{step}")
        want_states.append(copy.deepcopy(optimizer.state_dict()))
    results = run_on_ranks(_main_process_saves_alone, world_size=2 * replicas, args=(str(tmp_path / "pp"), replicas))
    assert [len(states) for states in results] == [STEPS] + [0] * (2 * replicas - 1)
    for step, (got, want) in enumerate(zip(results[0], want_states)):
        saved, expected = (load_file(tmp_path / run / f"step{step}" / "model.safetensors") for run in ("pp", "one"))
        assert sorted(saved) == sorted(expected)
        for name, weight in expected.items():
            assert torch.allclose(saved[name], weight, rtol=0, atol=1e-6), (step, name)
        assert got["param_groups"] == want["param_groups"]
        assert sorted(got["state"]) == sorted(want["state"])
        for index, state in want["state"].items():
            assert sorted(got["state"][index]) == sorted(state)
            for key, value in state.items():
                assert torch.allclose(got["state"][index][key], value, rtol=0, atol=1e-6), (step, index, key)
