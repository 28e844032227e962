"""Start a local Ray cluster (2 CPUs), run the requested TorchTrainer cases of ``train.py``, shut Ray down.

``python run_trainers.py OUT CASE...``; each case writes into ``OUT/CASE`` and its wall time into
``OUT/CASE/seconds``. Cases: ``plain`` (2 workers, no Ray checkpoints), ``failure`` (2 workers under the FSDP2
configuration file named by ``ACCELERATE_CONFIG_FILE``, given to the workers through the run's environment; a
worker killed after step 3, ``FailureConfig(max_failures=1)``: Ray restarts 2 workers from the step-2
checkpoint), ``shrink`` (after ``failure``: the step-2 checkpoint of the attempt that lost a worker, resumed
by a new run on 1 worker under the same file).
"""

import json
import os
import sys
import time

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import train  # noqa: E402

CASES = {}


def case(function):
    CASES[function.__name__] = function
    return function


def trainer(out, workers, config, *, max_failures=0, env=None, resume=None, name="run"):
    run_config = RunConfig(storage_path=os.path.join(out, "ray_storage"), name=name,
                           failure_config=FailureConfig(max_failures=max_failures),
                           checkpoint_config=CheckpointConfig(num_to_keep=None),
                           worker_runtime_env={"env_vars": env} if env else None)
    return TorchTrainer(train, train_loop_config=dict(config, out=out), run_config=run_config,
                        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                        resume_from_checkpoint=resume)


@case
def plain(out):
    trainer(out, 2, {}).fit()


@case
def failure(out):
    trainer(out, 2, {"report_every": 2, "kill_at": 3, "fsdp": True}, max_failures=1, env=_config_file()).fit()


@case
def shrink(out):
    # The checkpoint Ray kept when the `failure` run lost a worker, resumed by a new run on one worker.
    # (Ray 2.60's elastic ScalingConfig(num_workers=(1, 2)) shrinks only when the cluster's resources do, which a
    # one-machine test cannot arrange reliably; Ray Train V2 has no `resume_from_checkpoint`: the training
    # function loads the checkpoint it is given when Ray has none, hasten.integrations.ray.load_checkpoint.)
    kept = os.path.join(os.path.dirname(out), "failure", "ray_storage", "run", "step_2")
    trainer(out, 1, {"report_every": 2, "resume_from": kept, "fsdp": True}, env=_config_file()).fit()


def _config_file():
    return {"ACCELERATE_CONFIG_FILE": os.environ["RAY_TEST_CONFIG_FILE"]}


def main(out, names):
    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True, _temp_dir=os.environ["RAY_TEST_TEMP_DIR"])
    print(f"ray.init took {time.monotonic() - started:.1f} s", flush=True)
    try:
        for name in names:
            folder = os.path.join(out, name)
            os.makedirs(folder, exist_ok=True)
            began = time.monotonic()
            CASES[name](folder)
            with open(os.path.join(folder, "seconds"), "w") as f:
                json.dump(time.monotonic() - began, f)
            print(f"case {name} took {time.monotonic() - began:.1f} s", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
