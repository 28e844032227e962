"""``pip install ./compat/accelerate``: the ``accelerate`` distribution that is hasten.

A venv layered over the Hugging Face venv (trl, peft, datasets; no Accelerate) the way the Makefile layers
``.hf-venv`` over ``.venv``, made without pip of its own so the layered ``.venv``'s pip and setuptools serve
it (seconds). The distribution goes in offline (``--no-index --no-build-isolation``); then pip sees TRL's and
PEFT's ``accelerate>=...`` met, ``import accelerate`` is hasten, and the ``accelerate`` command is hasten's.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.hf_stack import ROOT, accelerate_python, hf_env, hf_python, script

pytestmark = [pytest.mark.slow, pytest.mark.launch]

DISTRIBUTION = ROOT / "compat" / "accelerate"


def _site_packages(python: str | Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def _layered_venv(folder: Path, *layers: str) -> Path:
    """A venv without pip whose ``.pth`` adds ``layers`` (site-packages folders) behind its own, in order."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    adds = "; ".join(f"site.addsitedir({layer!r})" for layer in layers)
    Path(_site_packages(python), "zz_layers.pth").write_text(f"import site; {adds}\n")
    return python


def _run(argv: list, tmp_path: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=tmp_path, env=hf_env(tmp_path), capture_output=True,
                          text=True, timeout=timeout)


def _ok(argv: list, tmp_path: Path, timeout: int = 180) -> str:
    out = _run(argv, tmp_path, timeout)
    assert out.returncode == 0, f"{argv} exited {out.returncode}\n{out.stdout[-6000:]}\n{out.stderr[-6000:]}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """The layered venv with ``./compat/accelerate`` installed: its python."""
    folder = tmp_path_factory.mktemp("accelerate-venv")
    # .venv's site-packages before .hf-venv's: .hf-venv holds a setuptools older than torch asks for.
    python = _layered_venv(folder / "venv", _site_packages(ROOT / ".venv" / "bin" / "python"),
                           _site_packages(hf_python()))
    _ok([python, "-m", "pip", "install", "--no-index", "--no-build-isolation", DISTRIBUTION], folder, timeout=240)
    return python


def test_pip_sees_trl_and_peft_requirements_met_and_pip_check_clean(venv, tmp_path):
    assert "No broken requirements found." in _ok([venv, "-m", "pip", "check"], tmp_path)
    # Offline: resolving trl and peft again needs no Accelerate from anywhere; pip names hasten's as theirs.
    out = _ok([venv, "-m", "pip", "install", "--no-index", "trl", "peft"], tmp_path)
    assert "Requirement already satisfied: accelerate>=1.10.1" in out and "(1.15.0+hasten)" in out
    listing = _ok([venv, "-m", "pip", "list", "--format=freeze"], tmp_path)
    assert "accelerate==1.15.0+hasten" in listing.splitlines()


def test_import_accelerate_is_hasten(venv, tmp_path):
    out = _ok([venv, "-c", "import accelerate.utils, hasten, importlib.metadata as m; "
                           "from accelerate.utils import FullyShardedDataParallelPlugin as P; "
                           "from hasten._accelerate_alias import real_accelerate_installed as real; "
                           "print(accelerate.utils is hasten.utils, accelerate.Accelerator is hasten.Accelerator, "
                           "P is hasten.FullyShardedDataParallelPlugin, accelerate.__version__, real())"], tmp_path)
    assert out.split()[-5:] == ["True", "True", "True", "1.15.0", "False"]


def test_accelerate_command_is_hasten_cli(venv, tmp_path):
    accelerate = Path(venv).parent / "accelerate"
    out = _ok([accelerate, "env"], tmp_path)
    assert "accelerate version: 1.15.0+hasten" in out and "run `hasten config`" in out
    train = script(tmp_path, """
        import accelerate, hasten
        acc = accelerate.Accelerator()
        with open(f"rank{acc.process_index}.txt", "w") as out:  # a file each: printed lines may interleave
            out.write(f"RANK {acc.process_index} {acc.num_processes} {type(acc) is hasten.Accelerator}")
    """)
    _ok([accelerate, "launch", "--cpu", "--num_processes", "2", train], tmp_path)
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)] == ["RANK 0 2 True", "RANK 1 2 True"]
    # `transformers env` imports accelerate itself (its console script, run with this venv's interpreter)
    out = _ok([venv, "-c", "import sys; from transformers.cli.transformers import main; sys.argv[1:] = ['env']; "
                           "sys.exit(main())"], tmp_path)
    assert "- Accelerate version: 1.15.0" in out and "- Accelerate config: \tnot found" in out


def test_refuses_to_build_or_import_beside_the_real_accelerate(venv, tmp_path):
    real = _site_packages(accelerate_python())  # .hf-acc-venv: Accelerate 1.15 itself
    beside = _layered_venv(tmp_path / "beside", _site_packages(venv), real)
    out = _run([beside, "-c", "import accelerate"], tmp_path)
    assert out.returncode != 0
    assert "installed beside the real Accelerate (1.15.0 at" in out.stderr and "HINT" in out.stderr
    over = _layered_venv(tmp_path / "over", _site_packages(ROOT / ".venv" / "bin" / "python"), real)
    out = _run([over, "-m", "pip", "install", "--no-index", "--no-build-isolation", DISTRIBUTION], tmp_path)
    assert out.returncode != 0 and "the real Accelerate is installed here (accelerate 1.15.0" in out.stdout + out.stderr
    assert "accelerate==1.15.0+hasten" not in _ok([over, "-m", "pip", "freeze"], tmp_path)


def test_trl_sft_runs_on_hasten(venv, tmp_path):
    """``trl sft`` (which calls ``accelerate launch`` in-process) on a tiny GPT-2 and 16 lines of text."""
    prepare = script(tmp_path, """
        import json, sys
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
        words = "the a cat dog sat ran on mat park big small red blue".split()
        vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]", *words])}
        raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                eos_token="[EOS]").save_pretrained("model")
        GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                   bos_token_id=2, eos_token_id=3, pad_token_id=0)).save_pretrained("model")
        with open("train.jsonl", "w") as f:
            for i in range(16):
                f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(6))}) + "\\n")
    """, name="prepare.py")
    _ok([venv, prepare], tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "train.jsonl").rename(tmp_path / "data" / "train.jsonl")
    # This venv holds no Accelerate but hasten's distribution: TRL's `accelerate launch` is hasten's launcher.
    out = _ok([venv, "-c", "import sys; from trl.cli.main import main; sys.exit(main())", "sft",
               "--model_name_or_path", "model", "--dataset_name", "data", "--output_dir", "out", "--max_steps", "2",
               "--per_device_train_batch_size", "4", "--max_length", "16", "--report_to", "none",
               "--save_strategy", "no", "--use_cpu", "--bf16", "false", "--logging_steps", "1",
               "--num_processes", "2", "--cpu"], tmp_path, timeout=300)
    assert "Training completed" in out and "'epoch': '1'" in out
    assert (tmp_path / "out" / "model.safetensors").is_file()
