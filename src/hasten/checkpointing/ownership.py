"""Which entries of a folder hasten wrote, and removing exactly those.

Replacing a checkpoint, pruning old ones and clearing leftovers of an interrupted save delete files.
They delete only what this module proves is hasten's (or Accelerate's) own:

* with a manifest (:mod:`hasten.checkpointing.manifest`): the regular files it lists, reached without
  following a symbolic link, whose size is the recorded one, and the folders holding them;
* without one (Accelerate's or an older hasten's checkpoint): the exact file names those libraries
  write at the top level, and inside the sub-folders DCP (``pytorch_model_fsdp_{i}``, ``optimizer_{i}``)
  and DeepSpeed (``pytorch_model{_i}``) write.

Anything else (a similar name, an empty folder, a symbolic link, a file changed since the save) is the
user's: a save refuses to replace it and pruning keeps it.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from hasten.checkpointing.manifest import MANIFEST, STAGING_MARKER, read_manifest

#: Top-level files of a checkpoint written by Accelerate or hasten (exact names, numbered variants).
_TOP_FILES = re.compile(
    r"^(?:model(?:_\d+)?\.safetensors|pytorch_model(?:_fsdp)?(?:_\d+)?\.bin|optimizer(?:_\d+)?\.bin"
    r"|scheduler(?:_\d+)?\.bin|sampler(?:_\d+)?\.bin|dl_state_dict(?:_\d+)?\.bin|dataloader_state(?:_\d+)?\.bin"
    r"|scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl"
    r"|accumulated_gradients(?:_\d+)?_rank\d+\.safetensors|latest|zero_to_fp32\.py"
    rf"|{re.escape(MANIFEST)}|{re.escape(STAGING_MARKER)})$")
#: Sub-folders those libraries write, and the files each may hold (no deeper folders).
_DCP_FILES = re.compile(r"^(?:\.metadata|__\d+_\d+\.distcp)$")
_DEEPSPEED_FILES = re.compile(r"^(?:(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(?:optim|model)_states\.pt"
                              r"|mp_rank_\d+_model_states\.pt|layer_\d+-model_\d+-model_states\.pt)$")
_SUB_FOLDERS = ((re.compile(r"^(?:pytorch_model_fsdp|optimizer)(?:_\d+)?$"), _DCP_FILES),
                (re.compile(r"^pytorch_model(?:_\d+)?$"), _DEEPSPEED_FILES))


def _walk(folder: Path) -> tuple[list[str], list[str], list[str]]:
    """``(files, folders, others)`` under ``folder`` as relative POSIX names, never following a link.

    ``others`` holds symbolic links (to files or folders) and special files.
    """
    files, folders, others = [], [], []
    for root, dirs, names in os.walk(folder):
        base = Path(root)
        for name in dirs + names:
            path = base / name
            rel = path.relative_to(folder).as_posix()
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                folders.append(rel)
            elif stat.S_ISREG(mode):
                files.append(rel)
            else:
                others.append(rel)
    return sorted(files), sorted(folders), sorted(others)


def _regular_inside(folder: Path, rel: str) -> os.stat_result | None:
    """``lstat`` of ``folder/rel`` if every component is a real folder and the last a regular file."""
    current = folder
    parts = rel.split("/")
    try:
        for part in parts[:-1]:
            current = current / part
            if not stat.S_ISDIR(os.lstat(current).st_mode):
                return None
        info = os.lstat(current / parts[-1])
    except OSError:
        return None
    return info if stat.S_ISREG(info.st_mode) else None


def _legacy_owned(rel: str) -> bool:
    parts = rel.split("/")
    if len(parts) == 1:
        return bool(_TOP_FILES.match(rel))
    if len(parts) == 2:
        return any(sub.match(parts[0]) and inner.match(parts[1]) for sub, inner in _SUB_FOLDERS)
    return False


def owned_files(folder: Path, manifest: dict[str, Any] | None = None, *, use_manifest: bool = True) -> list[str]:
    """The files of ``folder`` hasten may delete (see the module docstring), manifest last."""
    if use_manifest and manifest is None:
        manifest = read_manifest(folder)
    files, _folders, _others = _walk(folder)
    if manifest is None:
        owned = [rel for rel in files if _legacy_owned(rel)]
    else:
        listed = manifest["files"]
        owned = [rel for rel in files if rel == STAGING_MARKER or (
            rel in listed and (info := _regular_inside(folder, rel)) is not None and info.st_size == listed[rel]["size"])]
        if _regular_inside(folder, MANIFEST) is not None:
            owned.append(MANIFEST)
    return sorted(owned, key=lambda rel: rel == MANIFEST)


def foreign_entries(folder: Path) -> list[str]:
    """What in ``folder`` hasten did not write (empty: the folder may be replaced or deleted).

    Raises:
        CheckpointError: the folder's manifest is damaged or crafted (it is then not trusted either).
    """
    if not folder.is_dir():
        return []
    files, folders, others = _walk(folder)
    owned = set(owned_files(folder))
    needed = {str(Path(rel).parent.as_posix()) for rel in owned}
    needed = {prefix for rel in needed for prefix in _prefixes(rel)}
    foreign = [rel for rel in files if rel not in owned] + others
    foreign += [rel + "/" for rel in folders if rel not in needed]
    return sorted(foreign)


def _prefixes(rel: str) -> list[str]:
    parts = [] if rel == "." else rel.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def remove_owned(folder: Path) -> list[str]:
    """Delete hasten's files of ``folder``, then its emptied folders and itself; return what was kept.

    Nothing is followed through a symbolic link and nothing unproven is deleted: a folder that still
    holds something afterwards stays, and its remaining entries are returned.
    """
    if not folder.is_dir() or folder.is_symlink():
        return [folder.name] if folder.exists() or folder.is_symlink() else []
    try:
        owned = owned_files(folder)
    except Exception:  # noqa: BLE001 - a damaged manifest proves nothing: keep everything
        return [MANIFEST]
    for rel in owned:
        (folder / rel).unlink(missing_ok=True)
    _files, folders, _others = _walk(folder)
    for rel in sorted(folders, key=lambda r: r.count("/"), reverse=True):
        try:
            os.rmdir(folder / rel)
        except OSError:
            continue  # not empty: it holds the user's files
    try:
        os.rmdir(folder)
    except OSError:
        files, folders, others = _walk(folder)
        return files + others + [rel + "/" for rel in folders]
    return []


__all__ = ["foreign_entries", "owned_files", "remove_owned"]
