"""Where the configuration file lives, and reading/writing it (YAML or JSON, written atomically).

``--config_file``, else the file named by ``ACCELERATE_CONFIG_FILE``, else the default location:
``$HASTEN_HOME/default_config.yaml``, else ``$XDG_CACHE_HOME/hasten/default_config.yaml``,
else ``~/.cache/hasten/default_config.yaml``. Without one, Accelerate's default file
(``~/.cache/huggingface/accelerate/default_config.yaml``, or under ``$HF_HOME``) is read. Functions take an ``env`` mapping (the process
environment by default) so they can be tested without touching the real environment.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hasten.base.environment import current_environment
from hasten.config.schema import LaunchConfig
from hasten.exceptions import ConfigurationError

CONFIG_FILE_NAME = "default_config.yaml"
HOME_VAR = "HASTEN_HOME"
#: Names the configuration file when ``--config_file`` is not given (the variable Accelerate users set for it).
CONFIG_FILE_VAR = "ACCELERATE_CONFIG_FILE"


def config_home(env: Mapping[str, str] | None = None) -> Path:
    """The folder holding hasten's default configuration file.

    Example:
        >>> str(config_home({"HASTEN_HOME": "/data/hasten"}))
        '/data/hasten'
    """
    env = current_environment() if env is None else env
    if env.get(HOME_VAR):
        return Path(env[HOME_VAR]).expanduser()
    cache = env.get("XDG_CACHE_HOME")
    base = Path(cache).expanduser() if cache else Path(env.get("HOME") or Path.home()).expanduser() / ".cache"
    return base / "hasten"


def default_config_file(env: Mapping[str, str] | None = None) -> Path:
    """Path of the default configuration file (it may not exist yet).

    Example:
        >>> default_config_file({"XDG_CACHE_HOME": "/tmp/c"}).as_posix()
        '/tmp/c/hasten/default_config.yaml'
    """
    return config_home(env) / CONFIG_FILE_NAME


def accelerate_config_file(env: Mapping[str, str] | None = None) -> Path | None:
    """Accelerate's default configuration file, if one exists: ``$HF_HOME/accelerate/default_config.yaml``
    (``HF_HOME`` defaults to ``$XDG_CACHE_HOME/huggingface``, i.e. ``~/.cache/huggingface``), or the
    ``default_config.json`` older Accelerate versions wrote there.

    Example:
        >>> accelerate_config_file({"HF_HOME": "/nonexistent"}) is None
        True
    """
    env = current_environment() if env is None else env
    if env.get("HF_HOME"):
        hf_home = Path(env["HF_HOME"]).expanduser()
    else:
        cache = env.get("XDG_CACHE_HOME")
        base = Path(cache).expanduser() if cache else Path(env.get("HOME") or Path.home()).expanduser() / ".cache"
        hf_home = base / "huggingface"
    for name in (CONFIG_FILE_NAME, "default_config.json"):
        candidate = hf_home / "accelerate" / name
        if candidate.is_file():
            return candidate
    return None


def is_accelerate_config(path: Path | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``path`` is Accelerate's default file (found because hasten has none of its own)."""
    return path is not None and path == accelerate_config_file(env)


def find_config_file(config_file: str | os.PathLike[str] | None,
                     env: Mapping[str, str] | None = None) -> Path | None:
    """The file to read: ``config_file`` if given (it must exist), else the file named by
    ``ACCELERATE_CONFIG_FILE`` (it must exist), else hasten's default file if it exists, else Accelerate's
    default file (:func:`accelerate_config_file`) if that exists.

    Raises:
        ConfigurationError: ``config_file`` or ``ACCELERATE_CONFIG_FILE`` names no file.
    """
    named = (current_environment() if env is None else env).get(CONFIG_FILE_VAR, "").strip()
    if config_file is None and named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ConfigurationError(f"{CONFIG_FILE_VAR}={named!r}: no such file. HINT: fix the path, or unset "
                                     f"{CONFIG_FILE_VAR} to use the default configuration file.")
        return path
    if config_file is not None:
        path = Path(config_file).expanduser()
        if not path.is_file():
            raise ConfigurationError(f"--config_file {str(config_file)!r}: no such file. HINT: create one with "
                                     f"`hasten config --config_file {config_file}` or fix the path.")
        return path
    default = default_config_file(env)
    return default if default.is_file() else accelerate_config_file(env)


#: Bounds on a configuration file: a genuine one is a few kB, a few levels deep, with few aliases.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_NODES = 100_000


def _check_yaml_shape(text: str, path: Path) -> None:
    """Refuse a file too large or nested too deeply, from the parser's events (no recursion, no building)."""
    import yaml

    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigurationError(f"{path}: {len(text)} characters, more than a configuration file holds "
                                 f"(at most {MAX_CONFIG_BYTES}). HINT: regenerate it with `hasten config`.")
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark is not None else "?"
                raise ConfigurationError(f"{path}, line {line}: nested more than {MAX_CONFIG_DEPTH} levels deep; "
                                         "no configuration is. HINT: regenerate it with `hasten config`.")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def _yaml_children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    return []


def _check_expansion(node: Any, path: Path) -> None:
    """Refuse aliases that expand into more than :data:`MAX_CONFIG_NODES` values ("billion laughs") or
    refer to themselves; counted over the composed graph, where an alias is one shared node."""
    if node is None:
        return
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Any, bool]] = [(node, False)]
    while stack:  # iterative post-order: every child's expanded size before its parent's
        current, children_done = stack.pop()
        key = id(current)
        if children_done:
            open_nodes.discard(key)
            total = 1 + sum(sizes[id(child)] for child in _yaml_children(current))
            sizes[key] = min(total, MAX_CONFIG_NODES + 1)
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise ConfigurationError(f"{path}: an alias refers to the value that contains it; no configuration "
                                     "does. HINT: regenerate it with `hasten config`.")
        open_nodes.add(key)
        stack.append((current, True))
        stack.extend((child, False) for child in _yaml_children(current) if id(child) not in sizes)
    if sizes[id(node)] > MAX_CONFIG_NODES:
        raise ConfigurationError(f"{path}: its aliases expand to more than {MAX_CONFIG_NODES} values; no "
                                 "configuration is that large. HINT: regenerate it with `hasten config`.")


def read_config_dict(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse a YAML or JSON file into (mapping, line of each top-level key).

    Raises:
        ConfigurationError: unreadable or malformed file (the message gives the file and line).
    """
    import yaml  # only when a file is actually read

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(f"Cannot read the configuration file {path}: {exc.strerror}.") from None
    try:
        _check_yaml_shape(text, path)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _check_expansion(node, path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigurationError(f"{path}{line}: malformed YAML ({problem}). HINT: fix the file or regenerate "
                                 "it with `hasten config`.") from None
    if data is None:
        raise ConfigurationError(f"{path} is empty. HINT: regenerate it with `hasten config`.")
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    return data, lines


def load_config_file(path: str | os.PathLike[str]) -> LaunchConfig:
    """Read and validate a configuration file (Accelerate's files included).

    Example:
        >>> cfg = load_config_file("default_config.yaml")  # doctest: +SKIP
    """
    data, lines = read_config_dict(path)
    return LaunchConfig.from_dict(data, source=str(path), lines=lines)


def save_config_file(config: LaunchConfig | Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``config`` to ``path`` (JSON if it ends in ``.json``, else YAML), atomically.

    The content goes to a temporary file in the same folder, which is then renamed over ``path``,
    so a crash never leaves a half-written file where a good one stood.

    Example:
        >>> save_config_file(LaunchConfig(num_processes=2), "/tmp/cfg.yaml")  # doctest: +SKIP
    """
    data = config.to_dict() if isinstance(config, LaunchConfig) else dict(config)
    path = Path(path).expanduser()
    if path.suffix == ".json":
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    else:
        import yaml

        text = yaml.safe_dump(data, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None,
                       device_count: int | None = None) -> Path | None:
    """Write a configuration for this machine's devices; return its path, or ``None`` if a file exists.

    Like Accelerate's ``write_basic_config``, an existing file is never overwritten.

    Example:
        >>> write_basic_config("bf16", "/tmp/h/default_config.yaml", device_count=0)  # doctest: +SKIP
    """
    path = Path(save_location).expanduser() if save_location else default_config_file()
    if path.exists():
        return None
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    config = LaunchConfig(distributed_type="MULTI_GPU" if device_count > 1 else "NO",
                          num_processes=max(device_count, 1), use_cpu=device_count == 0,
                          mixed_precision=mixed_precision)
    return save_config_file(config, path)
