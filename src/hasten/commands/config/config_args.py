"""Accelerate's ``accelerate.commands.config.config_args``: the configuration file as a dataclass.

Transformers' and TRL's ``env`` commands read the launch configuration through these names
(``default_config_file``, ``load_config_from_file(...).to_dict()``). A cluster file is read and validated by
hasten's own config layer (``hasten.config.io``), so a file ``hasten launch`` refuses is refused here too;
``ClusterConfig``'s fields are that layer's keys (``LaunchConfig``), with Accelerate's defaults.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass
from typing import Any

from hasten._lazy import accelerate_path_getattr
from hasten.base.constants import (
    SAGEMAKER_PYTHON_VERSION,
    SAGEMAKER_PYTORCH_VERSION,
    SAGEMAKER_TRANSFORMERS_VERSION,
    SageMakerDistributedType,
)
from hasten.base.dataclasses import ComputeEnvironment, DistributedType
from hasten.config.io import (
    accelerate_config_file,
    default_config_file as _hasten_default,
    read_config_dict,
    save_config_file,
)
from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError

#: Accelerate's cache folders (where Accelerate keeps its default file; ``hasten launch`` reads it too).
hf_cache_home = os.path.expanduser(
    os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")))
cache_dir = os.path.join(hf_cache_home, "accelerate")
default_json_config_file = os.path.join(cache_dir, "default_config.yaml")
default_yaml_config_file = os.path.join(cache_dir, "default_config.yaml")


def _default_config_file() -> str:
    """The file ``hasten launch`` reads without ``--config_file``: hasten's, else Accelerate's, else hasten's path."""
    own = _hasten_default()
    if own.is_file():
        return str(own)
    theirs = accelerate_config_file()
    return str(theirs if theirs is not None else own)


#: The default configuration file, as a ``str`` path (it may not exist yet), as in Accelerate.
default_config_file = _default_config_file()


def _plain(value: Any) -> Any:
    """Enums as their values, empty blocks as ``None`` (left out of the file, as Accelerate does)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()} or None
    return value


@dataclass
class BaseConfig:
    """The keys every configuration file has, with ``to_dict`` and the file round-trips.

    A key the file does not set reads as ``None`` (``config.any_missing_key is None``).

    Example:
        >>> cfg = ClusterConfig(compute_environment="LOCAL_MACHINE", distributed_type="NO", mixed_precision="no",
        ...                     use_cpu=True, debug=False)
        >>> cfg.distributed_type is DistributedType.NO, cfg.to_dict()["mixed_precision"]
        (True, 'no')
    """

    compute_environment: ComputeEnvironment
    distributed_type: DistributedType | SageMakerDistributedType
    mixed_precision: str
    use_cpu: bool
    debug: bool

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return None  # a key this configuration does not have

    def __post_init__(self) -> None:
        self.compute_environment = ComputeEnvironment(self.compute_environment)
        sagemaker = self.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER
        kind = SageMakerDistributedType if sagemaker else DistributedType
        self.distributed_type = kind(self.distributed_type)
        if getattr(self, "dynamo_config", None) is None:  # a field of the subclasses, not of BaseConfig
            vars(self)["dynamo_config"] = {}

    def to_dict(self) -> dict[str, Any]:
        """The keys that are set, enums as their values (empty blocks and ``None`` left out)."""
        result = {field.name: _plain(getattr(self, field.name)) for field in dataclasses.fields(self)}
        return {key: value for key, value in result.items() if value is not None}

    @classmethod
    def _read(cls, path: str) -> dict[str, Any]:
        """The file's keys, validated by hasten's config layer (``LaunchConfig``)."""
        data, lines = read_config_dict(path)
        return LaunchConfig.from_dict(data, source=path, lines=lines).to_dict()

    @classmethod
    def _from_file(cls, path: str) -> BaseConfig:
        values = cls._read(path)
        unknown = sorted(set(values) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise ConfigurationError(f"{path}: keys {unknown} are not {cls.__name__} keys. HINT: remove them, or "
                                     "rewrite the file with `hasten config update`.")
        return cls(**values)

    @classmethod
    def from_json_file(cls, json_file: str | None = None) -> BaseConfig:
        """Read (and validate) a JSON configuration file."""
        return cls._from_file(default_json_config_file if json_file is None else str(json_file))

    @classmethod
    def from_yaml_file(cls, yaml_file: str | None = None) -> BaseConfig:
        """Read (and validate) a YAML configuration file."""
        return cls._from_file(default_yaml_config_file if yaml_file is None else str(yaml_file))

    def _write(self, path: str, suffix: str) -> None:
        """Validate the keys as ``hasten launch`` would, then write them atomically in the ``suffix`` format."""
        config = LaunchConfig.from_dict(self.to_dict(), source=f"this {type(self).__name__}")
        target = str(path)
        if target.endswith(".json") == (suffix == ".json"):  # the format save_config_file picks
            save_config_file(config, target)
            return
        # save_config_file picks the format from the suffix; Accelerate writes the format the method names
        text = (json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n" if suffix == ".json"
                else _yaml_text(config.to_dict()))
        with open(target, "w", encoding="utf-8") as handle:
            handle.write(text)

    def to_json_file(self, json_file: str) -> None:
        """Write the configuration as JSON (validated)."""
        self._write(json_file, ".json")

    def to_yaml_file(self, yaml_file: str) -> None:
        """Write the configuration as YAML (validated)."""
        self._write(yaml_file, ".yaml")


def _yaml_text(data: dict[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(data, sort_keys=True))


@dataclass
class ClusterConfig(BaseConfig):
    """A local machine's or cluster's launch configuration (``compute_environment: LOCAL_MACHINE``).

    The fields are ``hasten launch``'s configuration keys; ``num_processes=-1`` means "not set".
    """

    num_processes: int = -1
    machine_rank: int = 0
    num_machines: int = 1
    gpu_ids: str | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str | None = "static"
    same_network: bool | None = False
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    fp8_config: dict[str, Any] | None = None
    deepspeed_config: dict[str, Any] | None = None
    fsdp_config: dict[str, Any] | None = None
    parallelism_config: dict[str, Any] | None = None
    megatron_lm_config: dict[str, Any] | None = None
    mpirun_config: dict[str, Any] | None = None
    downcast_bf16: bool = False
    tpu_name: str | None = None
    tpu_zone: str | None = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: str | None = None
    commands: list[str] | None = None
    tpu_vm: list[str] | None = None
    tpu_env: list[str] | None = None
    dynamo_config: dict[str, Any] | None = None
    # hasten's keys beyond Accelerate's (None = not set, so the file stays readable by Accelerate)
    use_parallelism_config: bool | None = None
    min_machines: int | None = None
    preemption_signal: str | None = None
    replica_groups: int | None = None

    def __post_init__(self) -> None:
        for block in ("fp8_config", "deepspeed_config", "fsdp_config", "parallelism_config", "megatron_lm_config",
                      "mpirun_config"):
            if getattr(self, block) is None:
                setattr(self, block, {})
        super().__post_init__()


@dataclass
class SageMakerConfig(BaseConfig):
    """A SageMaker configuration file's keys: hasten reads them (``env`` reports them) but does not launch
    on SageMaker, so they are not validated against ``hasten launch``'s keys and cannot be written."""

    ec2_instance_type: str
    iam_role_name: str
    image_uri: str | None = None
    profile: str | None = None
    region: str = "us-east-1"
    num_machines: int = 1
    gpu_ids: str = "all"
    base_job_name: str = "accelerate-sagemaker-1"  # Accelerate's name, with its default num_machines
    pytorch_version: str = SAGEMAKER_PYTORCH_VERSION
    transformers_version: str = SAGEMAKER_TRANSFORMERS_VERSION
    py_version: str = SAGEMAKER_PYTHON_VERSION
    sagemaker_inputs_file: str | None = None
    sagemaker_metrics_file: str | None = None
    additional_args: dict[str, Any] | None = None
    dynamo_config: dict[str, Any] | None = None
    enable_cpu_affinity: bool = False

    @classmethod
    def _read(cls, path: str) -> dict[str, Any]:
        data = read_config_dict(path)[0]
        if not isinstance(data, dict):
            raise ConfigurationError(f"{path} must hold a mapping of keys to values, got {type(data).__name__}.")
        # Accelerate's defaults for the keys an old file may lack; the two instance keys read as None
        defaults = {"compute_environment": "AMAZON_SAGEMAKER", "distributed_type": "NO", "mixed_precision": "no",
                    "use_cpu": False, "debug": False, "ec2_instance_type": None, "iam_role_name": None}
        return {**defaults, **data}

    def _write(self, path: str, suffix: str) -> None:
        from hasten.base.refusals import SAGEMAKER, refusal

        raise refusal(f"{type(self).__name__}.to_{suffix[1:]}_file", SAGEMAKER)


def load_config_from_file(config_file: str | None) -> BaseConfig:
    """Read ``config_file`` (or the default file) as a ``ClusterConfig`` or ``SageMakerConfig``.

    Raises:
        FileNotFoundError: ``config_file`` was given and does not exist.
        ConfigurationError: the file is malformed or has keys ``hasten launch`` does not know.

    Example:
        >>> load_config_from_file("default_config.yaml").to_dict()  # doctest: +SKIP
        {'compute_environment': 'LOCAL_MACHINE', 'distributed_type': 'NO', ...}
    """
    if config_file is not None and not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"The passed configuration file `{config_file}` does not exist. Please pass an existing file to "
            "`hasten launch`, or use the default one created through `hasten config` and run `hasten launch` "
            "without the `--config_file` argument.")
    path = default_config_file if config_file is None else str(config_file)
    data = read_config_dict(path)[0]
    where = data.get("compute_environment", ComputeEnvironment.LOCAL_MACHINE.value) if isinstance(data, dict) else None
    config_class: type[BaseConfig] = SageMakerConfig if where == "AMAZON_SAGEMAKER" else ClusterConfig
    return config_class.from_json_file(path) if path.endswith(".json") else config_class.from_yaml_file(path)

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
