"""Every private API of ``hasten/_private_api.py`` works on the torch it is pinned to, and a torch upgrade
fails here first, loudly, so each one is re-checked instead of breaking silently in a run (the FSDP2
internals are what the bit-exact mid-window resume stands on)."""

import atexit

import pytest
import torch
from torch import nn

from hasten import _private_api as private


def test_torch_is_the_version_the_private_apis_were_checked_against():
    assert torch.__version__.startswith(private.CHECKED_TORCH + "."), (
        f"torch {torch.__version__} is installed but hasten/_private_api.py was checked against torch "
        f"{private.CHECKED_TORCH}: re-run this file, check each accessor against the new torch's source "
        f"({', '.join(private.__all__)}), then update CHECKED_TORCH.")


# On a forked rank with its own one-rank group: a gloo group in the pytest process would be inherited
# by every rank the harness forks later.
@pytest.mark.world_size(1)
def test_store_clone_and_mesh_flatten():
    from torch.distributed.device_mesh import init_device_mesh

    assert private.clone_default_store() is not None
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    private.flatten_mesh(mesh[("a", "b")], "ab")
    assert mesh["ab"].size() == 1


@pytest.mark.world_size(1)
def test_fsdp2_pending_gradients_round_trip():
    """What the mid-window save reads and the resume writes back: FSDP2's pending unsharded gradient."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    fully_shard(model)
    assert private.has_unshard_async(model) and private.set_unshard_async(model)
    model.set_requires_gradient_sync(False)
    model(torch.ones(4, 3)).sum().backward()
    records = private.fsdp_param_records(model)
    assert len(records) == 2
    pending = [private.pending_gradient(record) for record in records]
    assert all(grad is not None for grad in pending)
    weight_grad = pending[0].detach().clone()
    private.set_pending_gradient(records[0], weight_grad * 2)
    assert torch.equal(private.pending_gradient(records[0]), weight_grad * 2)


def test_imports_of_private_modules_resolve():
    assert callable(private.composable_checkpoint())
    assert callable(private.apply_activation_checkpointing())
    private.set_rotate_method("allgather")  # torch's default: setting it changes nothing


def test_module_to_parser_and_interpreter_and_pytest_internals(request):
    assert private.to_call_device(torch.device("cpu")) == torch.device("cpu")
    assert private.to_call_device(torch.float16) is None
    assert hasattr(atexit, "_run_exitfuncs")  # run_exit_functions is called for real by the launch tests
    assert private.run_before_threads_join(lambda: None)  # threading._register_atexit (exits in test_async_save_exit)
    assert "request" in private.fixture_argnames(request.node)


def test_a_moved_api_raises_a_clear_error():
    with pytest.raises(private.PrivateAPIError, match=r"_fsdp_param_group is not available in torch .* checked "
                                                      r"against torch .*HINT"):
        private.fsdp_param_records(nn.Linear(1, 1))
    with pytest.raises(private.PrivateAPIError, match="unsharded_accumulated_grad"):
        private.pending_gradient(object())
    with pytest.raises(private.PrivateAPIError, match="_fixtureinfo"):
        private.fixture_argnames(object())
    with pytest.raises(private.PrivateAPIError, match="_quorum_future .*torchft==0.2.0"):
        private.forget_failed_quorum(object())


def test_memory_planning_internals():
    """What ``hasten.plan_memory`` stands on: fake tensors, the fake backend's store, torch's trackers, and the
    hook through which DTensor's shape propagation finds the active fake mode."""
    import importlib

    with private.fake_tensor_mode():
        fake = torch.empty(1 << 30)  # 4 GiB, never allocated
        tracker = private.memory_tracker()
        with tracker:
            doubled = fake * 2
        assert tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] == doubled.nbytes
    assert hasattr(private.fake_process_group_store(), "set")
    propagation = importlib.import_module("torch.distributed.tensor._sharding_prop")
    original = propagation.detect_fake_mode
    with private.fake_tensor_mode() as mode:
        assert propagation.detect_fake_mode() is mode
        with private.dtensor_propagation_in_own_fake_mode():
            assert propagation.detect_fake_mode() is None
    assert propagation.detect_fake_mode is original


def test_device_meshes_built_inside_a_plan_keep_real_rank_tensors():
    """FSDP2 over a tensor-parallel mesh concatenates meshes inside ``fully_shard``; under a fake mode that
    fails on the mesh's real rank tensor unless the plan's context computes it for real."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    init, mesh_property = DeviceMesh.__dict__["__init__"], DeviceMesh.__dict__["mesh"]
    dist.init_process_group("fake", store=private.fake_process_group_store(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with private.fake_tensor_mode():
            with pytest.raises(AssertionError, match="FakeTensors"):
                DeviceMesh._concatenate([mesh["dp"], mesh["tp"]])
            with private.device_mesh_tensors_outside_fake_mode():
                assert DeviceMesh._concatenate([mesh["dp"], mesh["tp"]]).mesh.tolist() == [[0, 1], [2, 3]]
        # DTensor caches results by mesh shape, whatever its groups: a plan empties them between fake worlds
        import importlib

        from torch.distributed.tensor import Shard, distribute_tensor

        transform_plans = importlib.import_module("torch.distributed.tensor._redistribute")._gen_transform_infos
        distribute_tensor(torch.ones(4, 2), mesh["tp"], [Shard(0)]).full_tensor()
        assert transform_plans.cache_info().currsize > 0
        private.clear_dtensor_caches()
        assert transform_plans.cache_info().currsize == 0
    finally:
        dist.destroy_process_group()
    assert DeviceMesh.__dict__["__init__"] is init and DeviceMesh.__dict__["mesh"] is mesh_property
