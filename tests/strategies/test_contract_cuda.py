"""The GPU tier: the contract rows of ``test_contract.py`` on CUDA with NCCL, when GPUs are present.

The bodies are the contract's own (imported, not copied): a row runs under ``hasten launch`` with one
process per GPU, so the group is NCCL (plus gloo for CPU tensors) exactly as in a user's run, and the
result is held to the same one-process ground truth, the same tolerance and the same bit-exact resume.
A row needs as many GPUs as it has ranks; with fewer it is skipped (on CPU machines, all of them).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.requires_cuda, pytest.mark.launch]

#: Ranks per row (as in test_contract's world_size marks).
RANKS = {"single": 1, "ddp": 2, "fsdp2": 2, "deepspeed": 2, "hsdp": 4, "ddp_tp": 4, "fsdp2_tp": 4, "hsdp_tp": 8}

RUNNER = textwrap.dedent("""
    import sys
    from pathlib import Path

    sys.path.insert(0, {contract_dir!r})
    import test_contract as contract

    contract.ON_CPU[0] = False
    body, kind, folder = getattr(contract, sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    body(kind, folder) if "tmp_path" in body.__code__.co_varnames else body(kind)
    print("CONTRACT OK", kind, flush=True)
""")


#: The contract bodies run on each row (one launch each: every body ends its process group).
BODIES = ["test_the_state_answers_what_the_accelerator_answers",
          "test_train_accumulate_clip_match_one_process_on_the_whole_batch",
          "test_save_inside_an_accumulation_window_resumes_exactly"]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("kind", list(RANKS))
def test_contract_row_on_cuda(kind, body, tmp_path):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < RANKS[kind]:
        pytest.skip(f"the {kind} row needs {RANKS[kind]} CUDA GPUs, this machine has {gpus}")
    script = tmp_path / "run_row.py"
    script.write_text(RUNNER.format(contract_dir=str(Path(__file__).resolve().parent)))
    folder = tmp_path / "row"
    folder.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", HASTEN_HOME=str(tmp_path / "home"))
    env.pop("HASTEN_LAUNCH_CONFIG", None)
    command = [sys.executable, "-m", "hasten.commands.main", "launch", "--num_processes", str(RANKS[kind]),
               str(script), body, kind, str(folder)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count(f"CONTRACT OK {kind}") == RANKS[kind], out
