"""Big model inference, part 1: empty init, sizes, budgets and device-map arithmetic, hooks.

Device maps with GPU budgets are checked by their arithmetic (expected maps derived from Accelerate's
documented behaviour and its test cases); CUDA is never touched when ``max_memory`` is given.
"""

from collections import OrderedDict

import pytest
import torch
from torch import nn

from hasten.big_modeling import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    calculate_maximum_sizes,
    check_device_map,
    compute_module_sizes,
    convert_file_size_to_int,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    remove_hook_from_module,
    retie_parameters,
    set_module_tensor_to_device,
)
from hasten.big_modeling.dispatch import _auto_device_map


class ModelForTest(nn.Module):
    """Accelerate's test model: 236 bytes (linear1 64, batchnorm 72, linear2 100)."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class TinyLM(nn.Module):
    def __init__(self, d=8, n=4, vocab=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture
def no_cuda(monkeypatch):
    """Any CUDA query fails the test: budgets given by the user must be enough."""
    def boom(*args, **kwargs):
        raise AssertionError("CUDA was queried although max_memory was given")
    for name in ("is_available", "device_count", "mem_get_info", "current_device"):
        monkeypatch.setattr(torch.cuda, name, boom)


# ---------------------------------------------------------------- init


def test_init_empty_weights_puts_parameters_on_meta_and_keeps_buffers():
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(10_000, 10_000), nn.BatchNorm1d(10_000))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model[1].running_mean.device.type == "cpu"
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad
    with init_empty_weights(include_buffers=True):
        model = nn.BatchNorm1d(4)
    assert model.running_mean.device.type == "meta"
    # the patch is undone on exit
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_init_empty_weights_keeps_ties_and_requires_grad():
    with init_empty_weights():
        model = TinyLM()
        frozen = nn.Linear(2, 2)
        frozen.weight.requires_grad_(False)
    assert model.head.weight is model.embed.weight
    assert find_tied_parameters(model) == [["embed.weight", "head.weight"]]
    assert not frozen.weight.requires_grad


def test_init_on_device_cpu():
    with init_on_device("cpu"):
        layer = nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu"


# ---------------------------------------------------------------- sizes


def test_compute_module_sizes_and_dtype():
    model = ModelForTest()
    sizes = compute_module_sizes(model)
    assert (sizes[""], sizes["linear1"], sizes["batchnorm"], sizes["linear2"]) == (236, 64, 72, 100)
    half = compute_module_sizes(model, dtype=torch.float16)
    # floats halve, the int64 num_batches_tracked keeps its 8 bytes
    assert half["batchnorm"] == 32 + 8 and half[""] == 32 + 40 + 50
    assert compute_module_sizes(model, special_dtypes={"linear1.weight": torch.float16})["linear1"] == 24 + 16


def test_convert_file_size_to_int():
    assert convert_file_size_to_int("5GB") == 5 * 10**9
    assert convert_file_size_to_int("5GiB") == 5 * 2**30
    assert convert_file_size_to_int("8Gb") == 10**9  # lower-case b = bits
    assert convert_file_size_to_int("500MiB") == 500 * 2**20
    assert convert_file_size_to_int(123) == 123
    with pytest.raises(ValueError, match="5 gigs"):
        convert_file_size_to_int("5 gigs")


def test_get_max_memory_with_user_budget_sorts_and_never_queries_cuda(no_cuda):
    assert list(get_max_memory({"cpu": "1GB", 1: "2GB", 0: 10, "disk": "1TB"})) == [0, 1, "cpu", "disk"]
    assert get_max_memory({"0": "1KiB"}) == {0: 1024}
    mine = {"cpu": "60KB", 0: 10}
    get_max_memory(mine)
    assert mine == {"cpu": 60_000, 0: 10}  # converted in place, as Accelerate does (Transformers relies on it)
    with pytest.raises(ValueError, match="'gpu'"):
        get_max_memory({"gpu": 10})
    with pytest.raises(ValueError, match="max_memory\\['cpu'\\]"):
        get_max_memory({"cpu": "lots"})


def test_get_max_memory_measures_ram_without_budget():
    budget = get_max_memory()
    assert budget["cpu"] > 0


def test_ram_budget_is_psutils_available_memory():
    """Read from /proc/meminfo (no psutil import on the load path), it must agree with psutil's figure."""
    psutil = pytest.importorskip("psutil")
    before = psutil.virtual_memory().available
    measured = get_max_memory()["cpu"]
    after = psutil.virtual_memory().available
    assert 0.9 * min(before, after) <= measured <= 1.1 * max(before, after)


def test_walk_buffer_sizes_equal_the_per_module_computation():
    """One buffer table per walk must give each module what compute_module_total_buffer_size gives it."""
    from hasten.big_modeling.device_map import _init_walk
    from hasten.big_modeling.sizes import compute_module_total_buffer_size

    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(3, 4), shared, nn.Sequential(shared, nn.BatchNorm1d(4), nn.Linear(4, 2)))
    model[2][1].register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    for dtype in (None, torch.float16):
        walk = _init_walk(model, {"cpu": 10**6}, None, dtype, None)
        for name, module in model.named_modules(remove_duplicate=False):
            if name:
                assert walk.buffer_bytes(name, module, dtype) == compute_module_total_buffer_size(module, dtype=dtype)


@pytest.mark.parametrize("budget, expected", [
    ({0: 200, 1: 200}, {0: 200, 1: 200}),
    ({0: 200, 2: 200}, {0: 200, 2: 200}),
    ({0: 300, 1: 300}, {0: 215, 1: 300}),
    ({0: 300, 1: 500}, {0: 215, 1: 500}),
    ({0: 300, "cpu": 1000}, {0: 300, "cpu": 1000}),
    ({0: 0, 1: 300, 2: 300}, {0: 0, 1: 215, 2: 300}),
    ({0: 0, "cpu": 100}, {0: 0, "cpu": 100}),
])
def test_get_balanced_memory(no_cuda, budget, expected):
    # per GPU: 236 // 2 = 118, plus 1.25 x mean leaf module (236 / 3 = 78) = 97 -> 215; the last GPU keeps all
    assert get_balanced_memory(ModelForTest(), max_memory=budget) == expected


def test_get_balanced_memory_low_zero(no_cuda):
    budget = get_balanced_memory(ModelForTest(), max_memory={0: 300, 1: 300, 2: 300}, low_zero=True)
    # GPU 0 only gets what GPUs 1-2 cannot take: the model fits there, so nothing
    assert budget[0] == 0 and budget[2] == 300


def test_max_layer_size_and_calculate_maximum_sizes():
    model = nn.Sequential(ModelForTest(), ModelForTest())
    sizes = compute_module_sizes(model)
    assert get_max_layer_size(list(model.named_children()), sizes, []) == (100, ["0.linear2", "1.linear2"])
    assert get_max_layer_size(list(model.named_children()), sizes, ["ModelForTest"]) == (236, ["0", "1"])
    assert calculate_maximum_sizes(model) == (472, (100, ["0.linear2", "1.linear2"]))


# ---------------------------------------------------------------- device maps


def test_infer_auto_device_map_accelerate_cases(no_cuda):
    model = ModelForTest()
    # only linear1 fits on GPU 0: it keeps room for the largest layer (linear2, 100) in case of offload
    assert infer_auto_device_map(model, max_memory={0: 200, 1: 200}) == {"linear1": 0, "batchnorm": 1, "linear2": 1}
    # GPU 1 is not a main device: no room kept there
    assert infer_auto_device_map(model, max_memory={0: 200, 1: 172, 2: 200}) == {
        "linear1": 0, "batchnorm": 1, "linear2": 1}
    model.linear1.weight = model.linear2.weight
    assert infer_auto_device_map(model, max_memory={0: 200, 1: 200}) == {"": 0}
    model = nn.Sequential(ModelForTest(), ModelForTest(), ModelForTest())
    assert infer_auto_device_map(model, max_memory={0: 500, 1: 500}) == {
        "0": 0, "1.linear1": 0, "1.batchnorm": 0, "1.linear2": 1, "2": 1}
    assert infer_auto_device_map(model, max_memory={0: 500, 1: 500}, no_split_module_classes=["ModelForTest"]) == {
        "0": 0, "1": 1, "2": 1}


def test_infer_auto_device_map_tied_weights_stay_together(no_cuda):
    model = nn.Sequential(OrderedDict([("layer1", ModelForTest()), ("layer2", ModelForTest()),
                                       ("layer3", ModelForTest())]))
    model.layer3.linear2.weight = model.layer1.linear2.weight
    assert infer_auto_device_map(model, max_memory={0: 400, 1: 500}) == {
        "layer1": 0, "layer3.linear2": 0, "layer2": 1, "layer3.linear1": 1, "layer3.batchnorm": 1}
    model.layer2.linear2.weight = model.layer1.linear2.weight
    assert infer_auto_device_map(model, max_memory={0: 400, 1: 500}) == {
        "layer1": 0, "layer2.linear2": 0, "layer3.linear2": 0, "layer2.linear1": 1, "layer2.batchnorm": 1,
        "layer3.linear1": 1, "layer3.batchnorm": 1}
    model.layer2.linear1.weight = model.layer1.linear1.weight
    assert infer_auto_device_map(model, max_memory={0: 400, 1: 500}) == {
        "layer1": 0, "layer2.linear1": 0, "layer2.linear2": 0, "layer3.linear2": 0, "layer2.batchnorm": 1,
        "layer3.linear1": 1, "layer3.batchnorm": 1}
    model = nn.Sequential(OrderedDict([("linear1", nn.Linear(4, 4)), ("linear2", nn.Linear(6, 6)),
                                       ("linear3", nn.Linear(4, 4)), ("linear4", nn.Linear(6, 6))]))
    model.linear3.weight = model.linear1.weight
    model.linear3.bias = model.linear1.bias
    assert infer_auto_device_map(model, max_memory={0: 250, 1: 400}) == {
        "linear1": 0, "linear2": 1, "linear3": 0, "linear4": 1}


def test_tied_lm_head_follows_its_embedding(no_cuda):
    with init_empty_weights():
        model = TinyLM()  # embed 512 (head tied, counted once), blocks of 576
    device_map = infer_auto_device_map(model, max_memory={0: 2240, "cpu": 10_000}, no_split_module_classes=["Block"])
    assert device_map == {"embed": 0, "head": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": "cpu", "blocks.3": "cpu"}


def test_infer_auto_device_map_buffers_warning(no_cuda):
    model = ModelForTest()
    model.linear1.register_buffer("test_buffer1", torch.zeros(10, 2))
    model.batchnorm.register_buffer("test_buffer2", torch.zeros(10, 3))
    model.linear2.register_buffer("test_buffer3", torch.zeros(10, 3))
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        device_map = infer_auto_device_map(model, max_memory={0: 400, "cpu": "1GB"})
    assert device_map == {"linear1": 0, "batchnorm": "cpu", "linear2": "cpu"}


BLOCK = 2 * (4096 * 4096 + 4096) * 4  # one Block(4096) in float32: 134,250,496 bytes


@pytest.fixture(scope="module")
def big_meta_model():
    with init_empty_weights():
        return nn.Sequential(*[Block(4096) for _ in range(20)])  # 2.685 GB, never allocated


def _blocks(device_map):
    """Expand a (cleaned) map into block index -> device."""
    return {i: next(v for k, v in device_map.items() if k in ("", str(i))) for i in range(20)}


def test_gigabyte_budgets_sequential_gpu_gpu_cpu(no_cuda, big_meta_model):
    budget = {0: "1GB", 1: "1GB", "cpu": "2GB"}
    device_map = infer_auto_device_map(big_meta_model, max_memory=budget, no_split_module_classes=["Block"])
    # GPU 0 keeps one block of room: (1e9 - B) // B = 6 blocks; GPU 1 (not main): 1e9 // B = 7; the CPU the rest
    expected = {i: 0 if i < 6 else 1 if i < 13 else "cpu" for i in range(20)}
    assert _blocks(device_map) == expected
    # "auto" = balanced: 2.685 GB / 2 + 1.25 B > 1 GB, so the budgets stay and the map is the same
    assert _auto_device_map(big_meta_model, "auto", budget, ["Block"], None, False) == device_map
    # with half precision everything fits on the GPUs: 2 x (1e9 - B/2) // (B/2) ... GPU 0 takes 13, GPU 1 the rest
    half = infer_auto_device_map(big_meta_model, max_memory=budget, no_split_module_classes=["Block"],
                                 dtype=torch.float16)
    assert _blocks(half) == {i: 0 if i < 13 else 1 for i in range(20)}


def test_gigabyte_budgets_balanced_low_zero_and_sequential(no_cuda, big_meta_model):
    budget = {0: "4GB", 1: "4GB"}
    assert _auto_device_map(big_meta_model, "sequential", budget, ["Block"], None, False) == {"": 0}
    # balanced: per GPU = total // 2 + 1.25 B; GPU 0 keeps B free -> 10 blocks there, 10 on GPU 1
    balanced = _auto_device_map(big_meta_model, "balanced", budget, ["Block"], None, False)
    assert _blocks(balanced) == {i: 0 if i < 10 else 1 for i in range(20)}
    # balanced_low_0: GPU 0 only gets what GPU 1 cannot hold (nothing)
    assert _auto_device_map(big_meta_model, "balanced_low_0", budget, ["Block"], None, False) == {"": 1}
    # a main device smaller than the largest layer: the error says how much is needed
    with pytest.raises(ValueError, match=f"at least {BLOCK} bytes"):
        _auto_device_map(big_meta_model, "sequential", {"cpu": "100MB"}, ["Block"], None, False)
    with pytest.raises(ValueError, match="'fastest'.*'auto'"):
        _auto_device_map(big_meta_model, "fastest", budget, ["Block"], None, False)


@pytest.mark.filterwarnings("ignore:Current model requires")
def test_no_split_classes_are_never_split(no_cuda):
    model = nn.Sequential(ModelForTest(), ModelForTest(), ModelForTest())
    for budget in ({0: 300, 1: 300, "cpu": 2000}, {0: 400, "cpu": 700}, {"cpu": 600}):
        device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["ModelForTest"])
        assert all("." not in key for key in device_map), device_map


@pytest.mark.filterwarnings("ignore:Current model requires")
def test_fallback_allocation_fills_an_otherwise_empty_device(no_cuda):
    model = nn.Sequential(OrderedDict([("big1", ModelForTest()), ("small", nn.Linear(1, 1)), ("big2", ModelForTest())]))
    # GPU 0 (250) keeps 236 for the largest remaining layer, so big1 does not fit: without fallback GPU 0
    # stays empty; with fallback the 8-byte layer found further on goes there
    budget = {0: 250, "cpu": 1000}
    assert infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["ModelForTest"]) == {"": "cpu"}
    device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["ModelForTest"],
                                       fallback_allocation=True)
    assert device_map == {"small": 0, "big1": "cpu", "big2": "cpu"}


def test_check_device_map():
    model = ModelForTest()
    check_device_map(model, {"": "cpu"})
    check_device_map(model, {"linear1": 0, "batchnorm": "cpu", "linear2": "disk"})
    with pytest.raises(ValueError, match="linear2.weight.*'linear2'"):
        check_device_map(model, {"linear1": 0, "batchnorm": "cpu"})


# ---------------------------------------------------------------- tensors and hooks


def test_set_module_tensor_to_device_and_retie():
    with init_empty_weights():
        model = TinyLM()
    with pytest.raises(ValueError, match="meta device"):
        set_module_tensor_to_device(model, "blocks.0.fc1.weight", "cpu")
    with pytest.raises(ValueError, match="shape"):
        set_module_tensor_to_device(model, "blocks.0.fc1.weight", "cpu", value=torch.zeros(3, 3))
    set_module_tensor_to_device(model, "embed.weight", "cpu", value=torch.ones(16, 8, dtype=torch.float16))
    assert model.embed.weight.dtype == torch.float32  # takes the model's dtype, like load_state_dict
    assert model.head.weight.device.type == "meta"
    retie_parameters(model, [["embed.weight", "head.weight"]])
    assert model.head.weight is model.embed.weight
    set_module_tensor_to_device(model, "blocks.0.fc1.bias", "cpu", value=torch.ones(8), dtype=torch.float16)
    assert model.blocks[0].fc1.bias.dtype == torch.float16


def test_set_module_tensor_to_device_keeps_a_value_already_in_place():
    """A value with the target device and dtype becomes the parameter's data without a copy (as
    ``load_state_dict(assign=True)``); buffers keep the value object; other dtypes are still cast."""
    with init_empty_weights():
        model = ModelForTest()
    weight = torch.randn(4, 3)
    set_module_tensor_to_device(model, "linear1.weight", "cpu", value=weight)
    assert model.linear1.weight.data_ptr() == weight.data_ptr()
    assert isinstance(model.linear1.weight, nn.Parameter) and model.linear1.weight.requires_grad
    mean = torch.zeros(4)
    set_module_tensor_to_device(model, "batchnorm.running_mean", torch.device("cpu"), value=mean)
    assert model.batchnorm.running_mean is mean
    set_module_tensor_to_device(model, "linear1.bias", "cpu", value=torch.ones(4, dtype=torch.float64))
    assert model.linear1.bias.dtype == torch.float32 and model.linear1.bias.requires_grad
    moved = nn.Linear(2, 2)
    set_module_tensor_to_device(moved, "weight", "meta")
    assert moved.weight.device.type == "meta" and moved.weight.requires_grad


def test_model_hooks_chain_and_remove():
    class AddOne(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return (args[0] + 1,), kwargs

    class Double(ModelHook):
        def post_forward(self, module, output):
            return output * 2

    layer = nn.Linear(2, 2)
    x = torch.randn(3, 2)
    expected = layer(x + 1) * 2
    add_hook_to_module(layer, AddOne())
    add_hook_to_module(layer, Double(), append=True)
    assert isinstance(layer._hf_hook, SequentialHook)
    assert torch.equal(layer(x), expected)
    add_hook_to_module(layer, Double())  # replaces
    assert torch.equal(layer(x), layer._old_forward(x) * 2)
    remove_hook_from_module(layer)
    assert not hasattr(layer, "_hf_hook") and torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_align_devices_hook_offload_round_trip():
    layer = nn.Linear(4, 4)
    reference = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 4)
    expected = layer(x)
    add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu", offload=True, io_same_device=True))
    assert layer.weight.device.type == "meta"
    assert torch.equal(layer(x), expected)
    assert layer.weight.device.type == "meta"  # back on meta after the forward
    remove_hook_from_module(layer)
    assert torch.equal(layer.weight, reference["weight"])
