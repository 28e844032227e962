"""TensorBoard, MLflow and W&B trackers, read back with each library's own reader.

The tracker libraries are imported once here, before ranks are forked, so the forked ranks reuse them
(mlflow alone takes about a second to import). W&B runs offline with every endpoint pointed at a closed
local port, and MLflow uses a local ``file:`` store, so nothing here needs (or tries) the network.
"""

import glob
import json
import os
import time

import pytest
import torch

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402,F401 - imported before forking
from wandb.proto import wandb_internal_pb2  # noqa: E402

from hasten.accelerator._tracking import TrackingMixin  # noqa: E402
from hasten.state import AcceleratorState  # noqa: E402
from hasten.testing import run_on_ranks  # noqa: E402
from hasten.tracking import JSONLTracker, MLflowTracker, TensorBoardTracker, filter_trackers  # noqa: E402

CONFIG = {"lr": 0.05, "batch_size": 4, "optimizer": "sgd"}


def offline_env(tmp_path):
    """Environment for runs that must stay on this machine."""
    return {
        "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_DISABLE_GIT": "true",
        "WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_MACHINE_INFO": "true",
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # the discard port: any upload attempt fails locally
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow >= 3.7 wants opting in to the plain-file store
        "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",  # MLflow 3 phones home otherwise
    }


@pytest.fixture
def offline(tmp_path, monkeypatch):
    env = offline_env(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return env


class StandIn(TrackingMixin):
    def __init__(self, log_with, logging_dir):
        self.state = AcceleratorState(_from_accelerator=True)
        self.logging_dir = str(logging_dir)
        self.log_with = filter_trackers(log_with, self.logging_dir)
        self.trackers = []


# ------------------------------------------------------------------------------------- readers
def wandb_records(run_dir):
    """Records of a W&B ``.wandb`` transaction log: a 7-byte header, then LevelDB-style log blocks."""
    (path,) = glob.glob(os.path.join(run_dir, "*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7 or data[pos + 6] == 0:  # block trailer / zero padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a record still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk of a record
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_history_and_config(tmp_path):
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs  # one run: only the main process started one
    # run.finish() can return before wandb's writer has put the last records on disk (seen once in a loaded
    # suite: no history yet, then all of it a moment later): read once the log holds its closing `exit` record.
    deadline = time.monotonic() + 30
    records = wandb_records(runs[0])
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "wandb's transaction log has no exit record 30 s after finish()"
        time.sleep(0.05)
        records = wandb_records(runs[0])
    history, config = [], {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(item.nested_key) or item.key: item.value_json for item in record.history.item}
            history.append((record.history.step.num, float(items["loss"])))
        elif kind == "run":
            config.update({item.key: item.value_json for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: item.value_json for item in record.config.update})
    config.pop("_wandb", None)
    return history, {key: json.loads(value) for key, value in config.items()}


def tensorboard_scalars_and_hparams(folder, tag="loss"):
    accumulator = event_accumulator.EventAccumulator(str(folder))
    accumulator.Reload()
    scalars = [(event.step, event.value) for event in accumulator.Scalars(tag)]
    (run,) = [d for d in os.listdir(folder) if d[0].isdigit()]  # the timestamped hparams run
    hp = event_accumulator.EventAccumulator(os.path.join(folder, run))
    hp.Reload()
    content = hp.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    hparams = {key: (value.number_value if value.HasField("number_value") else value.string_value)
               for key, value in info.hparams.items()}
    return scalars, hparams, os.path.join(folder, run, "hparams.yml")


def mlflow_run(uri, experiment="proj"):
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # one run: only the main process started one
    return client, runs[0]


# ------------------------------------------------------------------------------------- the 2-rank run
def _two_rank_training(tmp):
    from hasten import Accelerator

    accelerator = Accelerator(log_with=["tensorboard", "mlflow", "wandb", "jsonl"], project_dir=tmp)
    accelerator.init_trackers("proj", config=CONFIG,
                              init_kwargs={"mlflow": {"tracking_uri": f"file:{tmp}/mlruns"}})
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG["lr"])
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(8, 3)
    y = x.sum(dim=1, keepdim=True)
    logged = []
    for step in range(3):
        shard = slice(accelerator.process_index * 4, accelerator.process_index * 4 + 4)
        loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = accelerator.gather(loss.detach()[None]).mean().item()
        accelerator.log({"loss": mean_loss}, step=step * 10)
        logged.append((step * 10, mean_loss))
    accelerator.end_training()
    return logged


def test_two_rank_run_logs_once_to_every_backend(tmp_path, offline):
    results = run_on_ranks(_two_rank_training, world_size=2, args=(str(tmp_path),), env=offline, timeout=90)
    logged = results[0]
    assert results[1] == logged and len(logged) == 3  # every rank saw the same values; rank 0 logged them

    scalars, hparams, yml = tensorboard_scalars_and_hparams(tmp_path / "proj")
    assert [s for s, _ in scalars] == [s for s, _ in logged]
    assert [v for _, v in scalars] == pytest.approx([v for _, v in logged], rel=1e-6)  # float32 in TB
    assert hparams == {"lr": pytest.approx(0.05), "batch_size": 4, "optimizer": "sgd"}
    assert os.path.exists(yml)
    assert len(glob.glob(str(tmp_path / "proj" / "events.out.tfevents.*"))) == 1  # one writer

    client, run = mlflow_run(f"file:{tmp_path}/mlruns")
    assert run.data.params == {k: str(v) for k, v in CONFIG.items()}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == logged

    history, config = wandb_history_and_config(tmp_path)
    assert history == logged
    assert config == CONFIG

    records = JSONLTracker.read(tmp_path / "proj")
    assert [(r["_step"], r["loss"]) for r in records] == logged
    assert JSONLTracker.read_config(tmp_path / "proj") == CONFIG


# ------------------------------------------------------------------------------------- single process details
def test_tensorboard_text_dicts_and_bad_values(tmp_path):
    tracker = TensorBoardTracker("proj", tmp_path, flush_secs=5)
    tracker.start()
    tracker.store_init_configuration({"layers": [64, 32], "dropout": None, "lr": torch.tensor(0.5)})
    tracker.log({"loss": torch.tensor(1.25), "note": "warmup", "acc": {"train": 0.5, "val": 0.25}}, step=2)
    with pytest.raises(TypeError, match="'grads'.*Tensor"):
        tracker.log({"grads": torch.ones(4)}, step=3)
    tracker.finish()
    scalars, hparams, yml = tensorboard_scalars_and_hparams(tmp_path / "proj")
    assert scalars == [(2, 1.25)]
    assert hparams == {"layers": "[64, 32]", "dropout": "None", "lr": 0.5}
    import yaml

    assert yaml.safe_load(open(yml)) == {"layers": [64, 32], "dropout": None, "lr": 0.5}
    text = event_accumulator.EventAccumulator(str(tmp_path / "proj"))
    text.Reload()
    assert text.Tensors("note/text_summary")[0].tensor_proto.string_val == [b"warmup"]
    assert os.path.isdir(tmp_path / "proj" / "acc_train") and os.path.isdir(tmp_path / "proj" / "acc_val")


def test_mlflow_params_metrics_and_what_it_cannot_take(tmp_path, offline, caplog):
    uri = f"file:{tmp_path}/mlruns"
    acc = StandIn("mlflow", tmp_path)
    acc.init_trackers("proj", config={"lr": 0.1, "long": "x" * 7000, "tags": ["a", "b"]},
                      init_kwargs={"mlflow": {"tracking_uri": uri, "run_name": "first", "tags": '{"team": "x"}'}})
    acc.log({"loss": torch.tensor(0.5), "acc": {"train": 1, "val": 0.75}, "phase": "train"}, step=4)
    acc.log({"loss": 0.25, "phase": "eval"})  # no step: MLflow records step 0
    assert [r.getMessage() for r in caplog.records if "'phase' holds text" in r.getMessage()] == [
        "mlflow tracker: 'phase' holds text; MLflow metrics are numbers, so it is not logged to MLflow."]
    with pytest.raises(TypeError, match="'weights'.*list"):
        acc.log({"weights": [1.0, 2.0]}, step=5)
    assert acc.get_tracker("mlflow", unwrap=True).info.run_name == "first"
    acc._finish_trackers()
    client, run = mlflow_run(uri)
    assert run.data.params == {"lr": "0.1", "tags": "['a', 'b']"}  # the over-long value was dropped
    assert run.data.tags["team"] == "x" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(4, 0.5), (0, 0.25)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "acc/val")] == [0.75]
    assert "phase" not in run.data.metrics


def test_mlflow_tracker_rejects_bad_tags_text():
    with pytest.raises(ValueError, match="JSON object"):
        MLflowTracker("proj", tags="{not json")


def test_wandb_offline_single_process(tmp_path, offline):
    acc = StandIn("wandb", tmp_path)
    acc.init_trackers("proj", config={"lr": 0.1}, init_kwargs={"wandb": {"name": "run-a"}})
    acc.log({"loss": torch.tensor(2.0)}, step=1)
    acc.log({"loss": 1.0}, step=2)
    run = acc.get_tracker("wandb", unwrap=True)
    assert run.name == "run-a" and run.offline
    acc._finish_trackers()
    history, config = wandb_history_and_config(tmp_path)
    assert history == [(1, 2.0), (2, 1.0)] and config == {"lr": 0.1}
