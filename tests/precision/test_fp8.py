"""fp8 training through torchao (issue 15, item 5).

The hardware gate is a pure decision over the device's facts, so it is tested here with those facts
given; the float8 layers themselves run on this CPU too (torch's ``_scaled_mm`` has a CPU kernel), so
the end-to-end tests pretend only the capability query and train for real.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hasten.config.io import load_config_file
from hasten.connector import resolve_settings
from hasten.exceptions import ConfigurationError
from hasten.precision.fp8 import check_fp8_support, fp8_backend
from hasten.utils.fp8 import (
    AORecipeKwargs,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
    filter_linear_layers,
    find_first_last_linear_layers,
)

CONFIGS = Path(__file__).parents[1] / "fixtures" / "accelerate_configs"
HOPPER = {"on_cpu": False, "capability": (9, 0), "device_label": "NVIDIA H100", "torchao_available": True}


class Net(nn.Module):
    """Linear layers of every kind the filter distinguishes: first/last, aligned, misaligned, nested."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)          # first: kept in high precision
        self.block = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48))  # both convertible
        self.odd = nn.Linear(48, 30)           # 30 is not a multiple of 16
        self.head = nn.Linear(30, 1)           # last: kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.odd(torch.relu(self.block(torch.relu(self.embed(x)))))))


def _converted(model: nn.Module) -> set[str]:
    first, last = find_first_last_linear_layers(model)
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear)
            and filter_linear_layers(m, name, [n for n in (first, last) if n])}


# ------------------------------------------------------------------------------------------ the filter
def test_filter_skips_first_last_and_dimensions_not_multiple_of_16():
    assert find_first_last_linear_layers(Net()) == ("embed", "head")
    assert _converted(Net()) == {"block.0", "block.2"}
    assert find_first_last_linear_layers(nn.Sequential(nn.ReLU())) == (None, None)


def test_filter_on_a_single_linear_model_converts_nothing():
    assert _converted(nn.Sequential(nn.Linear(32, 32))) == set()  # it is both first and last


# ------------------------------------------------------------------------------------------ the gate
@pytest.mark.parametrize("facts, found", [
    ({"on_cpu": True, "capability": None}, "no CUDA GPU"),
    ({"on_cpu": True, "capability": (9, 0)}, "no CUDA GPU"),  # cpu=True on a Hopper machine
    ({"on_cpu": False, "capability": (8, 0), "device_label": "NVIDIA A100"}, "compute capability 8.0 \\(NVIDIA A100\\)"),
    ({"on_cpu": False, "capability": (8, 6), "device_label": "RTX 3090"}, "compute capability 8.6"),
], ids=["cpu", "cpu-flag-on-gpu", "ampere", "ampere-8.6"])
def test_gate_refuses_hardware_without_float8_units_naming_requirement_and_bf16(facts, found):
    with pytest.raises(ConfigurationError, match=f"compute capability 8.9 or newer.*this machine has .*{found}.*bf16"):
        check_fp8_support("AO", **{**HOPPER, **facts})


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_gate_accepts_ada_hopper_blackwell_with_torchao(capability):
    check_fp8_support("AO", **{**HOPPER, "capability": capability})


def test_gate_without_torchao_gives_the_pip_command():
    with pytest.raises(ConfigurationError, match="pip install torchao.*bf16"):
        check_fp8_support("AO", **{**HOPPER, "torchao_available": False})


@pytest.mark.parametrize("backend, package", [("TE", "transformer_engine"), ("MSAMP", "msamp")])
@pytest.mark.parametrize("installed", [False, True])
def test_transformer_engine_and_msamp_are_refused_naming_why_and_torchao(backend, package, installed):
    with pytest.raises(ConfigurationError, match=f"{package} is {'installed' if installed else 'not installed'}.*"
                                                 "engine is torchao.*AORecipeKwargs.*bf16"):
        check_fp8_support(backend, **HOPPER, backend_package_available=installed)


def test_backend_choice_follows_handlers_then_launch_config():
    assert fp8_backend({}) == "AO"
    assert fp8_backend({AORecipeKwargs: AORecipeKwargs()}, {"backend": "TE"}) == "AO"
    assert fp8_backend({TERecipeKwargs: TERecipeKwargs()}) == "TE"
    assert fp8_backend({MSAMPRecipeKwargs: MSAMPRecipeKwargs()}) == "MSAMP"
    assert fp8_backend({FP8RecipeKwargs: FP8RecipeKwargs()}) == "TE"  # Accelerate's default for the old recipe
    assert fp8_backend({FP8RecipeKwargs: FP8RecipeKwargs(backend="msamp")}) == "MSAMP"
    assert fp8_backend({}, {"backend": "msamp"}) == "MSAMP"
    with pytest.raises(ConfigurationError, match="'XLA' is not one of"):
        fp8_backend({}, {"backend": "xla"})


# ------------------------------------------------------------------------------ construction / launch
def test_accelerator_refuses_fp8_on_this_cpu_at_construction_and_leaves_no_state():
    from hasten import Accelerator

    with pytest.raises(ConfigurationError, match="compute capability 8.9 or newer.*bf16"):
        Accelerator(cpu=True, mixed_precision="fp8")
    with pytest.raises(ConfigurationError, match="Transformer Engine.*not available in hasten"):
        Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[TERecipeKwargs()])
    assert Accelerator(cpu=True).mixed_precision == "no"  # the refusal left nothing behind


@pytest.mark.parametrize("name, match", [
    ("fp8_ao.yaml", "compute capability 8.9 or newer"),
    ("fp8_te.yaml", "Transformer Engine \\(TE\\) is not available"),
    ("fp8_msamp.yaml", "MS-AMP \\(MSAMP\\) is not available"),
])
def test_accelerate_fp8_config_files_reach_the_gate(name, match):
    config = load_config_file(CONFIGS / name)
    assert config.mixed_precision == "fp8"
    with pytest.raises(ConfigurationError, match=match):
        resolve_settings({"cpu": True}, config)


@pytest.mark.parametrize("spelling", ["amax_history_len", "amax_history_length"])
def test_fp8_config_key_spellings_reach_the_gate(spelling):
    with pytest.raises(ConfigurationError, match="Transformer Engine"):
        resolve_settings({"cpu": True}, {"mixed_precision": "fp8", "fp8_config": {"backend": "TE", spelling: 16}})


@pytest.mark.launch
def test_launch_flag_mixed_precision_fp8_is_refused_in_the_worker(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from hasten import Accelerator\nAccelerator()\nprint('NOT REFUSED')\n")
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HASTEN_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    proc = subprocess.run([sys.executable, "-m", "hasten.commands.main", "launch", "--cpu", "--num_processes", "1",
                           "--mixed_precision", "fp8", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "NOT REFUSED" not in proc.stdout
    assert "compute capability 8.9 or newer" in proc.stdout + proc.stderr


def test_importing_hasten_does_not_import_torchao():
    code = "import sys, hasten, hasten.precision, hasten.utils; hasten.utils.AORecipeKwargs; print('torchao' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------- torchao, for real on the CPU
@pytest.fixture
def pretend_hopper(monkeypatch):
    """The capability query answers as an H100 would; everything else (torchao, the matmuls) is real."""
    pytest.importorskip("torchao.float8", reason="torchao is in the dev extra: `make install`")
    import hasten.connector

    monkeypatch.setattr(hasten.connector, "_fp8_hardware", lambda cpu: (False, (9, 0), "NVIDIA H100 (pretended)"))


def test_prepare_swaps_exactly_the_filtered_linears_for_float8(pretend_hopper):
    from torchao.float8.float8_linear import Float8Linear

    from hasten import Accelerator

    accelerator = Accelerator(mixed_precision="fp8")
    model = accelerator.prepare(Net())
    kinds = {name: type(m) for name, m in accelerator.unwrap_model(model).named_modules() if isinstance(m, nn.Linear)}
    assert {name for name, kind in kinds.items() if kind is Float8Linear} == {"block.0", "block.2"}
    assert kinds["embed"] is nn.Linear and kinds["odd"] is nn.Linear and kinds["head"] is nn.Linear
    assert accelerator.fp8_backend == "AO" and accelerator.native_amp


def test_recipe_module_filter_and_config_are_used(pretend_hopper):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from hasten import Accelerator

    config = Float8LinearConfig(pad_inner_dim=True)
    recipe = AORecipeKwargs(config=config, module_filter_func=lambda module, fqn: fqn in ("embed", "head"))
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe])
    model = accelerator.unwrap_model(accelerator.prepare(Net()))
    assert isinstance(model.embed, Float8Linear) and isinstance(model.head, Float8Linear)
    assert not isinstance(model.block[0], Float8Linear)
    assert model.embed.config.pad_inner_dim


def test_fp8_training_follows_the_fp32_run(pretend_hopper):
    from hasten import Accelerator

    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    x = torch.randn(64, 8)
    y = x.sum(dim=1, keepdim=True) / 3

    def train(net: nn.Module, accelerator: Accelerator | None) -> list[float]:
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
        if accelerator is not None:
            net, optimizer = accelerator.prepare(net, optimizer)
        losses = []
        for _ in range(30):
            loss = nn.functional.mse_loss(net(x), y)
            (accelerator.backward(loss) if accelerator is not None else loss.backward())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    fp32 = train(reference, None)
    fp8 = train(model, Accelerator(mixed_precision="fp8"))
    assert fp8[-1] < 0.05 * fp8[0], fp8  # it trains (fp32 reaches 0.7% of its first loss)
    # float8 (e4m3, dynamic scaling) + bf16 autocast: a few percent from the fp32 curve, not bit-equal
    assert fp8[:10] == pytest.approx(fp32[:10], rel=0.05), (fp8, fp32)
    assert fp8 != fp32
