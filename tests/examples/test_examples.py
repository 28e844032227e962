"""The main examples run as users run them: ``python example.py`` and ``hasten launch --num_processes 2``.

Ground truth used here:
* ``cv_example.py`` with its default settings reaches >= 95% on the held-out digits (2 processes).
* ``nlp_example.py`` fine-tunes MiniLM on a labelled pair set built below from templates (paraphrase
  = the same event told with synonyms and another word order; not a paraphrase = a different event);
  chance is 50% on the balanced validation set, the test asks for > 75%.
* A ``complete_*`` run resumed from a mid-epoch checkpoint prints, for the epoch after the resume,
  exactly the accuracy and summed training loss of the uninterrupted run (hasten's resume is exact:
  weights, optimizer, scheduler, RNG and data loader position).
* Bad input (missing file, wrong CSV column) ends with one ``error:`` line, no traceback, exit status 1.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(script: str, *args: str, cwd: Path, processes: int = 1, timeout: int = 240,
                launch_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``examples/<script>`` with python (1 process) or ``hasten launch`` (several); returns the result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    path = str(EXAMPLES / script)
    if processes == 1 and not launch_args:
        command = [sys.executable, path, *args]
    else:
        command = [sys.executable, "-m", "hasten.commands.main", "launch", *launch_args]
        if not launch_args:
            command += ["--num_processes", str(processes)]
        command += [path, *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def succeeded(done: subprocess.CompletedProcess) -> str:
    """The run's stdout, after checking that it exited cleanly."""
    assert done.returncode == 0, f"exit {done.returncode}\nSTDOUT:\n{done.stdout[-3000:]}\nSTDERR:\n{done.stderr[-3000:]}"
    return done.stdout


def epoch_lines(stdout: str) -> dict[int, str]:
    """``{epoch: rest of the line}`` for every ``epoch N: ...`` line."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^epoch (\d+): (.*)$", stdout, re.MULTILINE)}


def accuracy_of(line: str) -> float:
    return float(re.search(r"accuracy ([0-9.]+)", line).group(1))


# ------------------------------------------------------------------------------------- a labelled pair set
SUBJECTS = [("the cat", "the kitten"), ("my brother", "my older sibling"), ("the teacher", "the instructor"),
            ("the company", "the firm"), ("the doctor", "the physician"), ("our team", "our group"),
            ("the farmer", "the grower"), ("the child", "the kid"), ("the police", "the officers"),
            ("the president", "the head of state")]
ACTIONS = [("bought", "purchased", "a new car"), ("fixed", "repaired", "the old bicycle"),
           ("started", "began", "the meeting"), ("cancelled", "called off", "the trip"),
           ("wrote", "composed", "a long letter"), ("cleaned", "tidied", "the kitchen"),
           ("sold", "got rid of", "the house"), ("found", "discovered", "the missing keys"),
           ("visited", "went to see", "the museum"), ("painted", "coloured", "the fence")]
TIMES = [("yesterday", "the day before"), ("on monday", "at the start of the week"),
         ("last night", "the previous evening"), ("this morning", "earlier today"), ("in march", "during march")]


def make_pair(rng: random.Random, paraphrase: bool) -> tuple[str, str, int]:
    """One pair: the same event reworded (label 1) or a different event in the same style (label 0)."""
    subject, action, time = rng.choice(SUBJECTS), rng.choice(ACTIONS), rng.choice(TIMES)
    first = f"{subject[0].capitalize()} {action[0]} {action[2]} {time[0]}."
    if not paraphrase:
        subject = rng.choice([s for s in SUBJECTS if s != subject])
        action, time = rng.choice([a for a in ACTIONS if a != action]), rng.choice(TIMES)
    second = f"{time[1].capitalize()}, {subject[1]} {action[1]} {action[2]}."
    return first, second, int(paraphrase)


def write_pairs(path: Path, count: int, seed: int, header: tuple[str, ...] = ("sentence1", "sentence2", "label")) -> Path:
    rng = random.Random(seed)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(make_pair(rng, paraphrase=i % 2 == 0) for i in range(count))
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("pairs")
    return {"train": str(write_pairs(folder / "train.csv", 96, seed=1)),
            "dev": str(write_pairs(folder / "dev.csv", 64, seed=2))}


# --------------------------------------------------------------------------------------------- cv_example
@pytest.mark.launch
def test_cv_example_default_settings_reach_95_percent_on_two_processes(tmp_path):
    lines = epoch_lines(succeeded(run_example("cv_example.py", cwd=tmp_path, processes=2)))
    assert len(lines) == 5  # the default number of epochs
    assert accuracy_of(lines[4]) >= 0.95, lines


def test_cv_example_one_process_tiny_bf16(tmp_path):
    out = succeeded(run_example("cv_example.py", "--cpu", "--mixed_precision", "bf16", "--num_epochs", "1",
                                "--max_train_samples", "64", "--max_eval_samples", "50", cwd=tmp_path))
    assert re.search(r"epoch 0: accuracy [0-9.]+ \(\d+/50 held-out images\)", out), out


# ----------------------------------------------------------------------------------- complete_cv_example
CV_TINY = ("--num_epochs", "2", "--max_train_samples", "320", "--max_eval_samples", "100", "--output_dir", "ckpt")


@pytest.mark.parametrize("processes,every", [(1, "7"), pytest.param(2, "3", marks=pytest.mark.launch)])
def test_complete_cv_example_resumes_mid_epoch_exactly(tmp_path, processes, every):
    # 320 images, 32 per batch: 10 batches per epoch on one process (step 7 is mid-epoch 0), 5 on two (step 3).
    full = succeeded(run_example("complete_cv_example.py", *CV_TINY, "--checkpointing_steps", every,
                                 "--with_tracking", "--report_to", "jsonl", "--project_dir", "runs",
                                 cwd=tmp_path, processes=processes))
    assert (tmp_path / "ckpt" / f"step_{every}").is_dir()
    resumed = succeeded(run_example("complete_cv_example.py", *CV_TINY, "--resume_from_checkpoint", f"ckpt/step_{every}",
                                    cwd=tmp_path, processes=processes))
    assert f"Resumed from ckpt/step_{every}: epoch 0, step {every}" in resumed
    assert epoch_lines(resumed)[1] == epoch_lines(full)[1]  # accuracy and summed loss of the whole epoch 1
    logged = [json.loads(line) for line in (tmp_path / "runs" / "complete_cv_example" / "metrics.jsonl").open()]
    assert [entry["epoch"] for entry in logged] == [0, 1]


def test_complete_cv_example_resumes_from_an_epoch_checkpoint(tmp_path):
    # Epoch checkpoints are on epoch boundaries: the resumed run starts at epoch 1.
    full = succeeded(run_example("complete_cv_example.py", *CV_TINY, "--checkpointing_steps", "epoch", cwd=tmp_path))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch_0", "epoch_1"]
    resumed = succeeded(run_example("complete_cv_example.py", *CV_TINY, "--resume_from_checkpoint", "ckpt/epoch_0",
                                    cwd=tmp_path))
    assert set(epoch_lines(resumed)) == {1} and epoch_lines(resumed)[1] == epoch_lines(full)[1]


# -------------------------------------------------------------------------------------------- nlp_example
def test_nlp_example_beats_chance_on_the_pair_set(tmp_path, pairs):
    out = succeeded(run_example("nlp_example.py", "--train_file", pairs["train"], "--validation_file", pairs["dev"],
                                "--num_epochs", "2", "--batch_size", "8", "--lr", "2e-4", cwd=tmp_path))
    last = epoch_lines(out)[1]
    assert re.search(r"f1 [0-9.]+", last), out
    assert accuracy_of(last) > 0.75, out  # chance: 0.5 on the balanced validation set


@pytest.mark.launch
def test_nlp_example_two_processes_tiny(tmp_path, pairs):
    out = succeeded(run_example("nlp_example.py", "--train_file", pairs["train"], "--validation_file", pairs["dev"],
                                "--num_epochs", "1", "--batch_size", "4", "--max_train_samples", "16",
                                "--max_eval_samples", "15", "--mixed_precision", "bf16", cwd=tmp_path, processes=2))
    assert re.search(r"^epoch 0: accuracy [0-9.]+ f1 [0-9.]+$", out, re.MULTILINE), out


# ---------------------------------------------------------------------------------- complete_nlp_example
def nlp_tiny(pairs: dict[str, str], batch_size: str) -> tuple[str, ...]:
    return ("--train_file", pairs["train"], "--validation_file", pairs["dev"], "--num_epochs", "2", "--batch_size",
            batch_size, "--lr", "2e-4", "--max_train_samples", "32", "--max_eval_samples", "16", "--output_dir", "ckpt")


def test_complete_nlp_example_resumes_mid_epoch_exactly(tmp_path, pairs):
    # 32 pairs, 8 per batch: 4 steps per epoch; checkpoints at steps 3 (mid-epoch 0) and 6.
    full = succeeded(run_example("complete_nlp_example.py", *nlp_tiny(pairs, "8"), "--checkpointing_steps", "3",
                                 cwd=tmp_path))
    resumed = succeeded(run_example("complete_nlp_example.py", *nlp_tiny(pairs, "8"),
                                    "--resume_from_checkpoint", "ckpt/step_3", cwd=tmp_path))
    assert "Resumed from ckpt/step_3: epoch 0, batch 3" in resumed
    assert epoch_lines(resumed)[1] == epoch_lines(full)[1]  # accuracy, F1 and the summed loss of epoch 1


@pytest.mark.launch
def test_complete_nlp_example_two_processes_checkpoints_and_tracks(tmp_path, pairs):
    # 32 pairs, 4 per batch and process: 4 steps per epoch on each process; step 6 is mid-epoch 1.
    out = succeeded(run_example("complete_nlp_example.py", *nlp_tiny(pairs, "4"), "--checkpointing_steps", "6",
                                "--with_tracking", "--report_to", "jsonl", "--project_dir", "runs",
                                cwd=tmp_path, processes=2))
    assert set(epoch_lines(out)) == {0, 1}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_6"]
    assert (tmp_path / "ckpt" / "step_6" / "random_states_1.pkl").is_file()  # saved by both processes
    logged = (tmp_path / "runs" / "complete_nlp_example" / "metrics.jsonl").read_text().splitlines()
    assert len(logged) == 2 and {"accuracy", "f1", "train_loss"} <= set(json.loads(logged[-1]))


# -------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("script", ["nlp_example.py", "complete_nlp_example.py"])
def test_missing_file_stops_with_one_clear_message(tmp_path, pairs, script):
    done = run_example(script, "--train_file", "nowhere.csv", "--validation_file", pairs["dev"], cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == ("error: nowhere.csv: no such file. Give a CSV file with the columns "
                                   "sentence1,sentence2,label."), done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_wrong_column_name_stops_with_one_clear_message(tmp_path, pairs):
    bad = write_pairs(tmp_path / "bad.csv", 4, seed=3, header=("sentence1", "sentence_2", "label"))
    done = run_example("nlp_example.py", "--train_file", pairs["train"], "--validation_file", str(bad), cwd=tmp_path)
    assert done.returncode == 1
    message = done.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert message.startswith(f"error: {bad}: missing column(s) sentence2;"), message
    assert "'sentence1,sentence_2,label'" in message


# ------------------------------------------------------------------------------------- config templates
TEMPLATES = {"single_cpu.yaml": ("NO", 1), "multi_cpu.yaml": ("MULTI_CPU", 2), "multi_gpu.yaml": ("MULTI_GPU", 2),
             "multi_node.yaml": ("MULTI_GPU", 8), "fsdp2.yaml": ("FSDP", 2), "deepspeed.yaml": ("DEEPSPEED", 2)}


def test_every_config_template_is_listed():
    assert sorted(p.name for p in (EXAMPLES / "config_templates").glob("*.yaml")) == sorted(TEMPLATES)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_config_template_loads_through_hastens_config_loader(name):
    from hasten.config.io import load_config_file

    path = EXAMPLES / "config_templates" / name
    config = load_config_file(path)
    assert (config.distributed_type, config.num_processes) == TEMPLATES[name]
    assert "#" in path.read_text()  # commented for the reader
    if name == "fsdp2.yaml":
        from hasten.config.plugins.fsdp import fsdp_plugin_from_launch_config

        plugin = fsdp_plugin_from_launch_config(config.to_launch_dict())
        assert plugin.transformer_cls_names_to_wrap == ["Block"] and plugin.state_dict_type == "SHARDED_STATE_DICT"
    if name == "deepspeed.yaml":
        from hasten.config.plugins.deepspeed import deepspeed_plugin_from_launch_config

        assert deepspeed_plugin_from_launch_config(config.to_launch_dict()).zero_stage == 2
    if name == "multi_node.yaml":
        assert (config.num_machines, config.machine_rank, config.main_process_port) == (2, 0, 29500)
