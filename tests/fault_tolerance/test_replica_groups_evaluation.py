"""An evaluation loader prepared under replica groups: the usual Accelerate loop (``accelerator.prepare(eval_loader)``,
``model.eval()``, ``gather_for_metrics``) evaluates the whole set on every group, each sample once within a group,
with the metric of one process holding the same weights, and without the other groups: group 0 evaluates only
after group 1 has finished and the Lighthouse is gone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.replica_group_runs import run_launch

#: The first quorum waits for the slower group's start-up (tens of seconds on a loaded machine); nothing fails here.
QUORUM_TIMEOUT = 120
EVAL_SAMPLES = 37  # not a multiple of any group's global batch: the last batch is padded, gather_for_metrics cuts it

SCRIPT = '''
import json, os, socket, time
from urllib.parse import urlparse
import torch
from torch.utils.data import DataLoader, TensorDataset
from hasten import Accelerator

out = os.environ["FT_OUT"]
accelerator = Accelerator(cpu=True)  # --min_replicas 2: both groups in every committed step
group, rank = os.environ["HASTEN_REPLICA_GROUP"], accelerator.process_index
torch.manual_seed(0)
features, truth = torch.randn(96, 8), torch.randn(8, 1)
train = DataLoader(TensorDataset(torch.arange(96), features, features @ truth), batch_size=4, shuffle=True)
eval_x = torch.randn(EVAL_SAMPLES_HERE, 8)
evaluation = TensorDataset(torch.arange(EVAL_SAMPLES_HERE), eval_x, eval_x @ truth)
eval_loader = DataLoader(evaluation, batch_size=4)
torch.manual_seed(100)  # the same weights in every group and process, as a seeded script has
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, train, eval_loader = accelerator.prepare(model, optimizer, train, eval_loader)
model.train()
for ids, x, y in train:
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()

def lighthouse_gone():
    address = urlparse(os.environ["TORCHFT_LIGHTHOUSE"])
    try:
        socket.create_connection((address.hostname, address.port), timeout=1).close()
    except OSError:
        return True
    return False

if group == "0":  # evaluate with no peer and no Lighthouse: group 1 finished, so the launcher stopped it
    deadline = time.monotonic() + 120
    while not (os.path.exists(os.path.join(out, "done_g1")) and lighthouse_gone()):
        assert time.monotonic() < deadline, "group 1 did not finish, or the Lighthouse did not stop"
        time.sleep(0.1)
model.eval()
ids_seen, predictions = [], []
for ids, x, y in eval_loader:
    with torch.no_grad():
        prediction = model(x)
    ids, prediction, y = accelerator.gather_for_metrics((ids, prediction, y))
    ids_seen += ids.tolist()
    predictions.append(torch.cat([prediction, y], dim=1))
pairs = torch.cat(predictions)
mse = torch.nn.functional.mse_loss(pairs[:, 0], pairs[:, 1]).item()
if accelerator.is_main_process:
    weights = accelerator.unwrap_model(model).state_dict()
    torch.save({"weights": weights, "x": eval_x, "y": eval_x @ truth}, os.path.join(out, f"weights_g{group}.pt"))
    with open(os.path.join(out, f"eval_g{group}.json"), "w") as f:
        json.dump({"ids": ids_seen, "predictions": pairs[:, 0].tolist(), "mse": mse,
                   "batches": len(eval_loader)}, f)
if group == "1":
    accelerator.wait_for_everyone()
    open(os.path.join(out, "done_g1"), "w").close()
'''.replace("EVAL_SAMPLES_HERE", str(EVAL_SAMPLES))


@pytest.fixture(scope="module", params=[2, 4], ids=["2x1", "2x2"])
def evaluated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    out = tmp_path_factory.mktemp("evaluation")
    script = out / "evaluate.py"
    script.write_text(SCRIPT)
    proc = run_launch(out, script, "--num_processes", str(request.param), "--replica_groups", "2",
                              "--step_timeout", "5", "--quorum_timeout", str(QUORUM_TIMEOUT), "--min_replicas", "2")
    output = proc.stdout
    assert proc.returncode == 0, output[-4000:]
    return out, request.param // 2, output


@pytest.mark.launch
def test_every_group_gathers_the_whole_eval_set_exactly_once(evaluated: tuple[Path, int, str]) -> None:
    out, per_group, _ = evaluated
    for group in (0, 1):
        result = json.loads((out / f"eval_g{group}.json").read_text())
        assert sorted(result["ids"]) == list(range(EVAL_SAMPLES)), (group, result["ids"])
        # this process's shard of the whole set: ceil(37 / (4 x processes of the group)) batches
        assert result["batches"] == -(-EVAL_SAMPLES // (4 * per_group))


@pytest.mark.launch
def test_the_metric_equals_one_process_with_the_same_weights(evaluated: tuple[Path, int, str]) -> None:
    out, _, _ = evaluated
    metrics = []
    for group in (0, 1):
        saved = torch.load(out / f"weights_g{group}.pt")
        model = torch.nn.Linear(8, 1)
        model.load_state_dict(saved["weights"])
        with torch.no_grad():
            expected = model(saved["x"])[:, 0]
        result = json.loads((out / f"eval_g{group}.json").read_text())
        by_id = torch.tensor(result["predictions"])[torch.tensor(result["ids"]).argsort()]
        assert torch.allclose(by_id, expected, atol=1e-6)
        single = torch.nn.functional.mse_loss(expected, saved["y"][:, 0]).item()
        assert result["mse"] == pytest.approx(single, rel=1e-5)
        metrics.append(result["mse"])
    assert metrics[0] == metrics[1]  # the groups hold the same weights after the last committed step


def _loader(evaluating: bool, steps: list[int]) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    from hasten.fault_tolerance.data import ReplicaGroupLoader

    def no_group() -> Any:
        raise AssertionError("an evaluation pass must not build or join the replica group")

    data = DataLoader(TensorDataset(torch.arange(10)), batch_size=4)
    return ReplicaGroupLoader(data, no_group, 0, 1, None, num_groups=2, evaluation_loader=[("a",), ("b",), ("c",)],
                              evaluating=lambda: evaluating, optimizer_steps=lambda: steps[0])


def test_an_evaluation_pass_reads_the_group_loader_and_no_quorum() -> None:
    loader = _loader(evaluating=True, steps=[0])
    assert len(loader) == 3
    assert list(loader) == [("a",), ("b",), ("c",)]


def test_an_optimizer_step_during_an_evaluation_pass_is_refused() -> None:
    from hasten.exceptions import ConfigurationError

    steps = [0]
    batches = iter(_loader(evaluating=True, steps=steps))
    next(batches)
    steps[0] += 1  # optimizer.step() between two batches of the pass
    with pytest.raises(ConfigurationError, match=r"model\.train\(\) before iterating a training loader"):
        next(batches)
