"""Accelerate's ``accelerate.commands.config.config_utils``: what the ``config`` subcommands share.

Accelerate's prompt helpers (``_ask_field``, ``_ask_options``) are private; hasten's questionnaire asks through
``hasten.commands.questionnaire.Prompter``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hasten._lazy import accelerate_path_getattr

#: The torch.compile backends the ``config`` questionnaire offers, in Accelerate's order and spelling
#: (``TORHCHXLA_TRACE_ONCE`` is Accelerate's own typo, kept so that its answer numbers map the same).
DYNAMO_BACKENDS = ["EAGER", "AOT_EAGER", "INDUCTOR", "AOT_TS_NVFUSER", "NVPRIMS_NVFUSER", "CUDAGRAPHS", "OFI",
                   "FX2TRT", "ONNXRT", "TENSORRT", "AOT_TORCHXLA_TRACE_ONCE", "TORHCHXLA_TRACE_ONCE", "TVM"]


class SubcommandHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help for a ``config`` subcommand: descriptions kept as written, and the usage line without the
    ``{default,update}`` list of the parent's subcommands (which says nothing about this one)."""

    def _format_usage(self, usage: str | None, actions: Iterable[argparse.Action],
                      groups: Iterable[Any], prefix: str | None) -> str:
        text = super()._format_usage(usage, actions, groups, prefix)
        return text.replace("{default,update} ", "").replace("<command> [<args>] ", "")


def _target(path: str | None) -> Path:
    """The configuration file a ``config`` subcommand works on: ``path``, else the default file."""
    from hasten.config.io import default_config_file

    return Path(path).expanduser() if path else default_config_file()

# Names Accelerate's module at this path shows but defines elsewhere (hasten/_accelerate_shown.py).
__getattr__ = accelerate_path_getattr(__name__, globals())
