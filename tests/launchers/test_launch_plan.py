"""``hasten launch`` resolution without starting processes: precedence, flags, plans, bad input (exit 2)."""

import json
import socket
import sys

import pytest

from hasten.commands.launch import build_launch_parser, resolve_config
from hasten.commands.main import main
from hasten.config.io import save_config_file
from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError
from hasten.launchers.mpirun import mpirun_command
from hasten.launchers.plan import LaunchOptions, build_plan
from hasten.launchers.torchrun import torchrun_argv


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.setenv("HASTEN_HOME", str(tmp_path / "home"))
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def _args(*argv):
    import argparse

    return build_launch_parser(argparse.ArgumentParser()).parse_args(list(argv))


def _plan(config, script, env=None, **options):
    return build_plan(config, LaunchOptions(script=script, **options), env or {}, device_count=0)


def test_cli_beats_file_beats_defaults_and_both_spellings(tmp_path, script):
    cfg = tmp_path / "c.yaml"
    save_config_file(LaunchConfig(mixed_precision="bf16", num_processes=4, use_cpu=True, debug=True), cfg)
    resolved = resolve_config(_args("--config-file", str(cfg), "--num-processes", "2", script), {})
    assert (resolved.num_processes, resolved.mixed_precision, resolved.debug) == (2, "bf16", True)
    resolved = resolve_config(_args("--config_file", str(cfg), "--mixed_precision", "fp16", script, "--num_processes",
                                    "9"), {})
    assert (resolved.num_processes, resolved.mixed_precision) == (4, "fp16")  # args after the script are its own


def test_default_file_is_read_even_with_cpu(tmp_path, script, monkeypatch):
    save_config_file(LaunchConfig(num_processes=3, use_cpu=True), tmp_path / "home" / "default_config.yaml")
    assert resolve_config(_args("--cpu", script), {"HASTEN_HOME": str(tmp_path / "home")}).num_processes == 3


def test_cpu_multi_process_uses_torchrun_with_one_config_variable(script):
    plan = _plan(LaunchConfig(use_cpu=True, num_processes=2, mixed_precision="bf16"), script,
                 script_args=["--x", "1"])
    assert plan.launcher == "torchrun" and plan.nproc_per_node == 2 and plan.nnodes == 1
    assert [k for k in plan.env if k.startswith("HASTEN")] == ["HASTEN_LAUNCH_CONFIG", "HASTEN_PREEMPTION_DIR"]
    sent = json.loads(plan.env["HASTEN_LAUNCH_CONFIG"])
    assert (sent["use_cpu"], sent["mixed_precision"], sent["distributed_type"]) == (True, "bf16", "MULTI_CPU")
    assert plan.command[-3:] == [script, "--x", "1"]
    argv = torchrun_argv(plan, LaunchOptions(script=script, script_args=["--x", "1"]))
    assert argv[-3:] == [script, "--x", "1"] and argv[argv.index("--nproc_per_node") + 1] == "2"


def test_single_process_runs_the_script_through_the_worker_bootstrap(script):
    plan = _plan(LaunchConfig(), script)
    assert plan.launcher == "process" and plan.command == [sys.executable, "-m", "hasten.launchers.worker", script]


def test_deepspeed_accumulation_reaches_the_connector(script):
    from hasten.config.env import launch_config
    from hasten.connector import resolve_settings

    config = LaunchConfig(distributed_type="DEEPSPEED", num_processes=2,
                          deepspeed_config={"gradient_accumulation_steps": 4, "zero_stage": 2})
    env = _plan(config, script).env
    sent = launch_config(env)
    # the worker gets the typed config back (the injected top-level key is gone: it would fail the schema)
    assert isinstance(sent, LaunchConfig) and sent.deepspeed_config == config.deepspeed_config
    assert resolve_settings({}, sent).gradient_accumulation_steps == 4


def test_busy_port_is_replaced_on_one_machine_and_refused_on_the_main_of_many(script):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        plan = _plan(LaunchConfig(use_cpu=True, num_processes=2, main_process_port=port), script)
        assert plan.master_port != port and "in use" in plan.notes[0]
        with pytest.raises(ConfigurationError, match=f"main_process_port={port} is already in use"):
            _plan(LaunchConfig(use_cpu=True, num_processes=2, num_machines=2, main_process_port=port), script)


def test_c10d_multi_node_names_the_store_host(script):
    config = LaunchConfig(use_cpu=True, num_processes=2, num_machines=2, machine_rank=1, rdzv_backend="c10d",
                          main_process_ip="10.1.1.1", main_process_port=29400)
    plan = _plan(config, script)
    assert (plan.nproc_per_node, plan.node_rank, plan.rdzv_conf) == (1, 1, "is_host=0")
    argv = torchrun_argv(plan, LaunchOptions(script=script))
    assert argv[argv.index("--rdzv_endpoint") + 1] == "10.1.1.1:29400"


def test_slurm_step_layouts(script):
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_NTASKS_PER_NODE": "2",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    plan = _plan(LaunchConfig(), script, env=slurm)
    assert plan.launcher == "slurm-task" and plan.num_processes == 4
    one_per_node = {**slurm, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_NTASKS_PER_NODE": "1",
                    "SLURM_LOCALID": "0"}
    plan = _plan(LaunchConfig(use_cpu=True, num_processes=8), script, env=one_per_node)
    assert (plan.launcher, plan.nnodes, plan.node_rank, plan.nproc_per_node, plan.master_addr) == (
        "torchrun", 2, 1, 4, "n1")


def test_mpirun_commands():
    cmd = mpirun_command("mpirun", "openmpi", ["python", "t.py"], 4, 2, "hosts", ["MASTER_ADDR", "HASTEN_LAUNCH_CONFIG"])
    assert cmd[:3] == ["mpirun", "-n", "4"] and cmd[cmd.index("--npernode") + 1] == "2"
    assert cmd[cmd.index("--hostfile") + 1] == "hosts" and cmd.count("-x") == 2 and cmd[-2:] == ["python", "t.py"]
    cmd = mpirun_command("mpirun", "intel", ["python", "t.py"], 4, 2, "hosts", ["B", "A"])
    assert cmd[cmd.index("-ppn") + 1] == "2" and cmd[cmd.index("-genvlist") + 1] == "A,B"


def test_single_machine_openmpi_stays_on_loopback():
    def mca(cmd):
        return {cmd[i + 1]: cmd[i + 2] for i, part in enumerate(cmd) if part == "--mca"}

    assert mca(mpirun_command("mpirun", "openmpi", ["python", "t.py"], 2, 2, None, [], {})) == {
        "oob_tcp_if_include": "lo", "btl": "^tcp"}
    # the user's own Open MPI settings win; a run over a hostfile needs the network
    assert mca(mpirun_command("mpirun", "openmpi", ["python", "t.py"], 2, 2, None, [],
                              {"OMPI_MCA_btl": "self,tcp"})) == {"oob_tcp_if_include": "lo"}
    assert mca(mpirun_command("mpirun", "openmpi", ["python", "t.py"], 4, 2, "hosts", [], {})) == {}


def test_dry_run_prints_the_plan(script, capsys):
    assert main(["launch", "--dry_run", "--cpu", "--num_processes", "2", "--main_process_port", "0", script]) == 0
    out = capsys.readouterr().out
    assert "launcher:      torchrun" in out and "HASTEN_LAUNCH_CONFIG=" in out and "processes:     2" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["missing.py"], "does not exist"),
    (["--cpu", "--gpu_ids", "0", "{script}"], "use_cpu=True conflicts with gpu_ids='0'"),
    (["--num_processes", "0", "{script}"], "num_processes=0 must be at least 1"),
    (["--num_machines", "2", "--machine_rank", "2", "{script}"], "machine_rank=2 must be in 0..1"),
    (["--cpu", "--multi_gpu", "{script}"], "cannot be used together"),
    (["--use_fsdp", "--use_deepspeed", "{script}"], "cannot be used together"),
    (["--tpu", "{script}"], "not available in hasten"),
    (["--rdzv_backend", "zmq", "{script}"], "rdzv_backend='zmq' is not valid"),
    (["--num_processes", "3", "--num_machines", "2", "{script}"], "cannot be split evenly"),
    (["--config_file", "nope.yaml", "{script}"], "no such file"),
])
def test_bad_input_exits_2_with_one_message(script, capsys, argv, message):
    code = main(["launch", *[a.format(script=script) for a in argv]])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_gpu_launches_turn_on_nccls_flight_recorder_unless_set(script):
    config = LaunchConfig(num_processes=2, distributed_type="MULTI_GPU")
    plan = build_plan(config, LaunchOptions(script=script), {}, device_count=2)
    assert plan.env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and plan.env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    mine = build_plan(config, LaunchOptions(script=script), {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, device_count=2)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine.env  # the user's own setting is inherited as it is
    cpu = _plan(LaunchConfig(use_cpu=True, num_processes=2), script)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in cpu.env


def test_collective_timeout_reaches_the_workers(script):
    plan = _plan(LaunchConfig(use_cpu=True, num_processes=2), script, collective_timeout=2.5)
    assert plan.env["HASTEN_COLLECTIVE_TIMEOUT"] == "2.5"
