"""Start a local Ray cluster (2 CPUs), run the requested TorchTrainer cases of ``train.py``, shut Ray down.

``python run_trainers.py OUT CASE...``; each case writes into ``OUT/CASE`` and its wall time into
``OUT/CASE/seconds``. The cluster (``ray.cluster_utils.Cluster``) is a head node with 2 CPUs and a
second node without CPUs. Cases: ``plain`` (2 workers, no Ray checkpoints), ``failure`` (2 workers under the FSDP2
configuration file named by ``ACCELERATE_CONFIG_FILE``, given to the workers through the run's environment; a
worker killed after step 3, ``FailureConfig(max_failures=1)``: Ray restarts 2 workers from the step-2
checkpoint), ``elastic`` (the same file; ``ScalingConfig(num_workers=(1, 2))`` over two nodes; after step 3 the
second node is drained for preemption, every worker saves on Ray's notice, the node is removed, and Ray restarts
on 1 worker from that step-3 checkpoint). ``elastic`` comes last: the cluster has one node after it.
"""

import json
import os
import sys
import tempfile
import threading
import time

import ray
from ray.cluster_utils import Cluster
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import train  # noqa: E402

CASES = {}
CLUSTER = {}


def case(function):
    CASES[function.__name__] = function
    return function


def trainer(out, workers, config, *, max_failures=0, env=None, resume=None, name="run", resources=None):
    run_config = RunConfig(storage_path=os.path.join(out, "ray_storage"), name=name,
                           failure_config=FailureConfig(max_failures=max_failures),
                           checkpoint_config=CheckpointConfig(num_to_keep=None),
                           worker_runtime_env={"env_vars": env} if env else None)
    return TorchTrainer(train, train_loop_config=dict(config, out=out), run_config=run_config,
                        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False,
                                                     resources_per_worker=resources),
                        resume_from_checkpoint=resume)


@case
def plain(out):
    trainer(out, 2, {}).fit()


@case
def failure(out):
    trainer(out, 2, {"report_every": 2, "kill_at": 3, "fsdp": True}, max_failures=1, env=_config_file()).fit()


@case
def elastic(out):
    # Ray's elastic range: as many workers as the cluster's `slot` resources allow, 1 to 2; the second slot is on
    # the second node. After step 3 that node is drained for preemption (Ray's watcher polls every 0.5 s), every
    # worker saves on the notice, and the node is removed: Ray restarts on the one worker left.
    # After the loss Ray's resource view lags (its autoscaling coordinator refreshes every 20 s): its first try
    # asks for 2 workers again and waits for them until the group start-up timeout, then starts 1.
    os.environ.update(RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="30", RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="1",
                      RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="0.5")
    node = CLUSTER["second"]
    threading.Thread(target=_preempt, args=(node, out), daemon=True).start()
    trainer(out, (1, 2), {"report_every": 2, "preempt_at": 3, "leaving_node": node.node_id, "fsdp": True},
            max_failures=1, env=_config_file(), resources={"slot": 1}).fit()


def _wait_for(path):
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


def _preempt(node, out):
    from ray.core.generated import autoscaler_pb2

    _wait_for(os.path.join(out, "drain"))
    gcs = ray._raylet.GcsClient(address=CLUSTER["cluster"].address)
    accepted, why = gcs.drain_node(node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "preempted by the test", int(time.time() * 1000) + 60_000)
    print(f"drain of the second node accepted: {accepted} {why}", flush=True)
    _wait_for(os.path.join(out, "saved"))
    CLUSTER["cluster"].remove_node(node, allow_graceful=False)


def _config_file():
    return {"ACCELERATE_CONFIG_FILE": os.environ["RAY_TEST_CONFIG_FILE"]}


def main(out, names):
    started = time.monotonic()
    os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)  # where the cluster's address is written
    # The head node runs the CPU workers; the elastic case's workers need a `slot`, one on each node, and the
    # second node (no CPUs: nothing else goes there) is there from the start, so Ray's view of the cluster has it.
    cluster = CLUSTER["cluster"] = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"slot": 1}, "include_dashboard": False, "temp_dir": os.environ["RAY_TEST_TEMP_DIR"]})
    CLUSTER["second"] = cluster.add_node(num_cpus=0, resources={"slot": 1}, temp_dir=os.environ["RAY_TEST_TEMP_DIR"])
    ray.init(address=cluster.address)
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
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
