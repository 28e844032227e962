"""transformers' no-Trainer examples (``run_clm_no_trainer.py`` and ``run_mlm_no_trainer.py`` use Accelerate 0.x's
``DistributedType.TPU``) run on hasten through the ``accelerate`` alias, beside a folder named ``accelerate``."""

import json
from pathlib import Path

import pytest

from helpers.hf_stack import hasten_launch

pytestmark = pytest.mark.launch

SCRIPT = str(Path(__file__).resolve().parent / "hf_scripts" / "clm_no_trainer.py")


def test_clm_no_trainer_under_hasten_launch_beside_an_accelerate_folder(tmp_path):
    # A config folder named accelerate in the working directory must not shadow the alias in the workers.
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "cpu.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    out = hasten_launch(tmp_path, "--config_file", "accelerate/cpu.yaml", SCRIPT, str(tmp_path / "model"))
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["processes"] == 2 and result["tpu_warned"] is True
    assert result["evaluated"] == 10  # every evaluation sample once, the uneven last batch included
    assert result["losses"][-1] < result["losses"][0] and result["perplexity"] > 1
    assert result["reloaded_equal"] is True
