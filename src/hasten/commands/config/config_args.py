"""Accelerate's ``accelerate.commands.config.config_args``: the configuration file as an object.

Transformers' and TRL's ``env`` commands read the launch configuration through these names
(``default_config_file``, ``load_config_from_file(...).to_dict()``). The file is read and validated by
hasten's own config layer (``hasten.config.io``), so a file ``hasten launch`` refuses is refused here too.
"""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path
from typing import Any

from hasten.config.io import (
    accelerate_config_file,
    default_config_file as _hasten_default,
    read_config_dict,
    save_config_file,
)
from hasten.config.schema import LaunchConfig
from hasten.utils.dataclasses import ComputeEnvironment

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
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()} or None
    return value


class BaseConfig:
    """A configuration file's keys as attributes, with Accelerate's ``to_dict`` / file round-trips.

    Example:
        >>> BaseConfig(distributed_type="NO", mixed_precision="no").to_dict()["mixed_precision"]
        'no'
    """

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return None  # a key the file does not set (Accelerate's dataclass fields default to None)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def to_dict(self) -> dict[str, Any]:
        """The keys that are set, enums as their values (empty blocks and ``None`` left out)."""
        result = {key: _plain(value) for key, value in vars(self).items()}
        return {key: value for key, value in result.items() if value is not None}

    @classmethod
    def _from_file(cls, path: str) -> BaseConfig:
        if cls is SageMakerConfig:  # hasten does not launch on SageMaker: the keys are kept as written
            return cls(**read_config_dict(path)[0])
        data, lines = read_config_dict(path)
        return cls(**LaunchConfig.from_dict(data, source=path, lines=lines).to_dict())

    @classmethod
    def from_json_file(cls, json_file: str | None = None) -> BaseConfig:
        """Read (and validate) a JSON configuration file."""
        return cls._from_file(default_json_config_file if json_file is None else json_file)

    @classmethod
    def from_yaml_file(cls, yaml_file: str | None = None) -> BaseConfig:
        """Read (and validate) a YAML configuration file."""
        return cls._from_file(default_yaml_config_file if yaml_file is None else yaml_file)

    def to_json_file(self, json_file: str) -> None:
        """Write the configuration as JSON (atomically)."""
        Path(json_file).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def to_yaml_file(self, yaml_file: str) -> None:
        """Write the configuration as YAML (atomically, validated)."""
        save_config_file(self.to_dict(), yaml_file)


class ClusterConfig(BaseConfig):
    """A local machine's or cluster's launch configuration (``compute_environment: LOCAL_MACHINE``)."""


class SageMakerConfig(BaseConfig):
    """A SageMaker configuration file's keys (hasten reads them but does not launch on SageMaker)."""


def load_config_from_file(config_file: str | None) -> BaseConfig:
    """Read ``config_file`` (or the default file) as a ``ClusterConfig`` or ``SageMakerConfig``.

    Raises:
        FileNotFoundError: ``config_file`` was given and does not exist.

    Example:
        >>> load_config_from_file("default_config.yaml").to_dict()  # doctest: +SKIP
        {'compute_environment': 'LOCAL_MACHINE', 'distributed_type': 'NO', ...}
    """
    if config_file is not None and not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"The passed configuration file `{config_file}` does not exist. Please pass an existing file to "
            "`hasten launch`, or use the default one created through `hasten config` and run `hasten launch` "
            "without the `--config_file` argument.")
    path = default_config_file if config_file is None else config_file
    data = read_config_dict(path)[0]
    local = data.get("compute_environment", ComputeEnvironment.LOCAL_MACHINE.value) == "LOCAL_MACHINE"
    config_class: type[BaseConfig] = ClusterConfig if local else SageMakerConfig
    return config_class.from_json_file(path) if path.endswith(".json") else config_class.from_yaml_file(path)
