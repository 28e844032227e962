"""The ``hasten config`` questionnaire: plain numbered prompts, default in brackets.

Works in any terminal and with answers piped on stdin (one answer per line; an empty line or the end
of input takes the default). A wrong answer is asked again, up to a few times, then raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hasten.exceptions import ConfigurationError

_MAX_TRIES = 3


class Prompter:
    """Ask questions through ``read`` (``input`` by default) and ``write`` (``print``).

    Example:
        >>> answers = iter(["2", ""])
        >>> p = Prompter(read=lambda prompt: next(answers), write=lambda *a: None)
        >>> p.integer("How many?", 1), p.yes_no("Sure?", True)
        (2, True)
    """

    def __init__(self, read: Callable[[str], str] | None = None, write: Callable[..., None] | None = None) -> None:
        self._read = read or input
        self._write = write or print

    def _answer(self, prompt: str) -> str | None:
        try:
            return self._read(prompt).strip()
        except EOFError:
            return None  # piped answers ran out: take the defaults from here on

    def _ask(self, prompt: str, convert: Callable[[str], Any], default: Any) -> Any:
        for _ in range(_MAX_TRIES):
            raw = self._answer(prompt)
            if raw is None or raw == "":
                return default
            try:
                return convert(raw)
            except ValueError as exc:
                self._write(f"  {exc}")
        raise ConfigurationError(f"No valid answer to {prompt.strip()!r} after {_MAX_TRIES} tries.")

    def integer(self, question: str, default: int, minimum: int = 0) -> int:
        """An integer >= ``minimum``."""
        def convert(raw: str) -> int:
            value = int(raw)
            if value < minimum:
                raise ValueError(f"please enter a number >= {minimum}")
            return value
        return int(self._ask(f"{question} [{default}]: ", convert, default))

    def text(self, question: str, default: str | None = None) -> str | None:
        """Free text (``default`` when left empty)."""
        shown = f" [{default}]" if default not in (None, "") else ""
        return self._ask(f"{question}{shown}: ", str, default)  # type: ignore[no-any-return]

    def yes_no(self, question: str, default: bool = False) -> bool:
        """A yes/no answer."""
        def convert(raw: str) -> bool:
            if raw.lower() in ("y", "yes", "true", "1"):
                return True
            if raw.lower() in ("n", "no", "false", "0"):
                return False
            raise ValueError("please answer yes or no")
        return bool(self._ask(f"{question} [{'YES/no' if default else 'yes/NO'}]: ", convert, default))

    def choice(self, question: str, options: Sequence[str], default: int = 0) -> str:
        """One of ``options``, by number or by name."""
        self._write(question)
        for index, option in enumerate(options):
            self._write(f"  [{index}] {option}")

        def convert(raw: str) -> str:
            if raw.isdigit() and int(raw) < len(options):
                return options[int(raw)]
            for option in options:
                if option.lower() == raw.lower():
                    return option
            raise ValueError(f"please enter a number between 0 and {len(options) - 1}")
        return str(self._ask(f"Choose a number [{default}]: ", convert, options[default]))


MACHINE_TYPES = ("No distributed training", "multi-CPU", "multi-GPU")
DYNAMO_BACKENDS = ("eager", "aot_eager", "inductor", "cudagraphs")


def ask_cluster(p: Prompter) -> dict[str, Any]:
    """Machine type, machines, rendezvous; returns Accelerate's keys."""
    machine = p.choice("Which type of machine are you using?", MACHINE_TYPES)
    kind = {"No distributed training": "NO", "multi-CPU": "MULTI_CPU", "multi-GPU": "MULTI_GPU"}[machine]
    cfg: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "distributed_type": kind, "num_machines": 1,
                           "machine_rank": 0, "use_cpu": kind == "MULTI_CPU"}
    if kind != "NO":
        cfg["num_machines"] = p.integer("How many different machines will you use (more than 1 for multi-node "
                                        "training)?", 1, minimum=1)
        if cfg["num_machines"] > 1:
            cfg["machine_rank"] = p.integer("What is the rank of this machine?", 0)
            if cfg["machine_rank"] >= cfg["num_machines"]:
                raise ConfigurationError(f"machine rank {cfg['machine_rank']} must be below the number of "
                                         f"machines ({cfg['num_machines']}).")
            cfg["main_process_ip"] = p.text("What is the IP address of the machine that will host the main "
                                            "process?")
            cfg["main_process_port"] = p.integer("What is the port you will use to communicate with the main "
                                                 "process?", 29500)
            cfg["same_network"] = p.yes_no("Are all the machines on the same local network?", True)
            cfg["rdzv_backend"] = p.choice("What rendezvous backend will you use?", ("static", "c10d"))
            if cfg["rdzv_backend"] == "c10d":
                fewest = p.integer(f"How many of the {cfg['num_machines']} machines must remain for the run to go on "
                                   f"(fewer than {cfg['num_machines']}: machines may leave and join)?",
                                   cfg["num_machines"], minimum=1)
                if fewest < cfg["num_machines"]:
                    cfg["min_machines"] = fewest
        cfg["debug"] = p.yes_no("Should distributed operations be checked while running for errors (turns some "
                                "hangs into errors, slightly slower)?", False)
    else:
        cfg["use_cpu"] = p.yes_no("Do you want to run your training on CPU only (even if a GPU is available)?")
    if kind == "MULTI_CPU" and p.yes_no("Do you want hasten to launch mpirun?", False):
        cfg["mpirun_config"] = {"mpirun_hostfile": p.text("Please enter the path to the hostfile to use with "
                                                          "mpirun", "~/hostfile")}
    return cfg


def ask_engines(p: Prompter, cfg: dict[str, Any]) -> None:
    """torch.compile, DeepSpeed and FSDP questions (the engines only for multi-GPU)."""
    if p.yes_no("Do you wish to optimize your script with torch dynamo?", False):
        backend = p.choice("Which dynamo backend would you like to use?", DYNAMO_BACKENDS, default=2)
        cfg["dynamo_config"] = {"dynamo_backend": backend.upper()}
    if cfg["distributed_type"] != "MULTI_GPU":
        return
    if p.yes_no("Do you want to use DeepSpeed?", False):
        cfg["distributed_type"] = "DEEPSPEED"
        stage = p.choice("What should be your DeepSpeed's ZeRO optimization stage?", ("0", "1", "2", "3"), 2)
        cfg["deepspeed_config"] = {
            "zero_stage": int(stage),
            "offload_optimizer_device": p.choice("Where to offload optimizer states?", ("none", "cpu", "nvme")),
            "offload_param_device": p.choice("Where to offload parameters?", ("none", "cpu", "nvme")),
            "gradient_accumulation_steps": p.integer("How many gradient accumulation steps are you passing in "
                                                     "your script?", 1, minimum=1),
        }
        return
    if p.yes_no("Do you want to use FullyShardedDataParallel?", False):
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": p.yes_no("Do you want to enable resharding after forward?", True),
            "fsdp_offload_params": p.yes_no("Do you want to offload parameters and gradients to CPU?", False),
            "fsdp_auto_wrap_policy": p.choice("What should be your auto wrap policy?",
                                              ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")),
            "fsdp_state_dict_type": p.choice("What should be your FSDP's state dict type?",
                                             ("SHARDED_STATE_DICT", "FULL_STATE_DICT")),
            "fsdp_activation_checkpointing": p.yes_no("Do you want to enable FSDP activation checkpointing?"),
            "fsdp_cpu_ram_efficient_loading": p.yes_no("Do you want to enable CPU RAM efficient model loading?",
                                                       True),
        }


def ask_processes(p: Prompter, cfg: dict[str, Any]) -> None:
    """Number of processes, GPU ids and mixed precision."""
    if cfg["distributed_type"] == "NO":
        cfg["num_processes"] = 1
    else:
        unit = "CPU processes" if cfg["distributed_type"] == "MULTI_CPU" else "processes (GPUs)"
        cfg["num_processes"] = p.integer(f"How many {unit} should be used for distributed training, in total over "
                                         "all machines?", 2 * cfg["num_machines"], minimum=1)
    if not cfg.get("use_cpu"):
        cfg["gpu_ids"] = p.text("What GPU(s) (by id) should be used for training on this machine as a "
                                "comma-separated list?", "all")
    cfg["mixed_precision"] = p.choice("Do you wish to use mixed precision?", ("no", "fp16", "bf16", "fp8"))


def run_questionnaire(prompter: Prompter | None = None) -> dict[str, Any]:
    """Ask every question and return the configuration as a dict of Accelerate's keys.

    Example:
        >>> run_questionnaire()  # doctest: +SKIP
    """
    p = prompter or Prompter()
    cfg = ask_cluster(p)
    ask_engines(p, cfg)
    ask_processes(p, cfg)
    return cfg
