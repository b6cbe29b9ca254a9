"""Reading a DCP checkpoint as data: ``.metadata`` through an allow-list of DCP's own types, every pickled item
through ``torch.load(weights_only=True)``, every storage path inside the checkpoint's folder (docs/reliability.md,
"Trust").

DCP's ``FileSystemReader.read_metadata`` reads ``.metadata`` with ``pickle.load`` and its ``DefaultLoadPlanner``
reads every non-tensor item with ``torch.load(weights_only=False)``: whoever can write into a checkpoint's folder
can make a load run their code. :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` read the same files
without running anything: a global that is not on the allow-list is refused, before it is called, by
:class:`UnsafeCheckpoint`, one line naming the file (or item) and the type it holds. Each rank's reader checks every
pickled item it reads before it reads any tensor, so a rank that refuses changes nothing of what it loads into.

The allow-list of ``.metadata`` is DCP's metadata types (torch 2.11-2.15), ``torch.Size``, dtypes, layouts and
paths; that of an item is ``torch.load``'s ``weights_only`` one. Both take the types a user allows deliberately
with ``torch.serialization.add_safe_globals`` (or its ``safe_globals`` context): one opt-in for both, by type.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

METADATA_FILE = ".metadata"  # DCP's name of a checkpoint's metadata file (``__<rank>.metadata``: a rank's own)

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",  # TensorProperties' memory format, an Enum of DCP's
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),  # where an item lies in which file
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name (torch.strided)
    "torch": frozenset({"Size"}),  # and every torch.dtype, torch.layout, torch.memory_format (_torch_constant)
}
"""The globals ``.metadata`` may name (module -> names): what DCP's ``FileSystemWriter`` pickles into it."""

PATH_MODULES = ("pathlib", "pathlib._local")  # where a path's class lives (Python 3.13: pathlib._local)
PATH_CLASSES = frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"})
"""A path DCP pickles (``StorageMeta.checkpoint_id``) is read as its text: the class is never built, so no state a
pickle sets on it can make its text differ from the path it names."""

HOW_TO_ALLOW = (
    "a type of your own that you trust loads once you allow it with torch.serialization.add_safe_globals([...]) "
    '(docs/reliability.md, "Trust")'
)


class UnsafeCheckpoint(ValueError):
    """A checkpoint refused because reading it would run code or reach outside its folder: one line naming the file
    or item and what it holds. Nothing of it was called, and the refusing rank read nothing into its state dict."""


def _torch_constant(name: str) -> bool:
    return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


def _user_allowed(module: str, name: str) -> Any:
    """The global ``module.name`` if the user allowed it with ``torch.serialization.add_safe_globals``, else None."""
    for entry in torch.serialization.get_safe_globals():
        obj, spelled = entry if isinstance(entry, tuple) else (entry, None)
        where = (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
        if spelled == f"{module}.{name}" or (spelled is None and where == (module, name)):
            return obj
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle``'s unpickler whose globals come from :data:`ALLOWED_GLOBALS` (and the user's allowed types) only:
    every other global is refused when the stream names it, before anything calls it (Python's documented way to
    restrict what a pickle may run: ``Unpickler.find_class``)."""

    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED_GLOBALS.get(module, ()) or (module == "torch" and _torch_constant(name)):
            return super().find_class(module, name)
        if module in PATH_MODULES and name in PATH_CLASSES:
            return _path_text
        allowed = _user_allowed(module, name)
        if allowed is not None:
            return allowed
        raise UnsafeCheckpoint(
            f"{self.where} holds {module}.{name}, which is not one of DCP's metadata types: refused before it runs; "
            f"{HOW_TO_ALLOW}"
        )


def _path_text(*parts: Any) -> str:
    """A pickled path's parts joined as text (POSIX separators)."""
    return str(pathlib.PurePosixPath(*(str(part) for part in parts)))


def _unpickle_metadata(stream, where: str) -> Metadata:
    try:
        metadata = _MetadataUnpickler(stream, where).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001  (a pickle of allowed types that does not build: not DCP's metadata)
        raise UnsafeCheckpoint(f"{where} is not DCP's metadata ({type(exc).__name__}: {exc}): refused") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{where} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _escapes(relative: Any, folder: str) -> bool:
    """Whether a storage path of the metadata leaves the checkpoint's folder: not text, absolute, through ``..``,
    or (a local folder) a file whose real path, symbolic links followed, is outside the folder's."""
    if type(relative) is not str:
        return True
    if pathlib.PurePosixPath(relative).is_absolute() or pathlib.PureWindowsPath(relative).is_absolute():
        return True
    if ".." in pathlib.PurePosixPath(relative.replace("\\", "/")).parts:
        return True
    if "://" in folder:
        return False
    real = os.path.realpath(folder)
    return os.path.commonpath([real, os.path.realpath(os.path.join(folder, relative))]) != real


def check_item(value: io.BytesIO, where: str) -> None:
    """Refuse a pickled item (DCP's ``BytesIO`` of a non-tensor value) whose unpickling would call a global that
    ``torch.load(weights_only=True)`` does not allow; leaves ``value`` at its start."""
    value.seek(0)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(value)
    except Exception as exc:  # noqa: BLE001  (not a torch.save archive: nothing torch.load reads safely)
        raise UnsafeCheckpoint(f"{where} is not a torch.save archive ({type(exc).__name__}: {exc}): refused") from None
    value.seek(0)
    if unsafe:
        raise UnsafeCheckpoint(
            f"{where} holds {', '.join(unsafe)}, which torch.load(weights_only=True) does not allow: refused before "
            f"it runs; {HOW_TO_ALLOW}"
        )


def container_at(tree: Any, path: list) -> Any:
    """The dictionary or list of a nested state dict at ``path`` (keys and indices), where a flattened key's value
    lives."""
    for key in path:
        tree = tree[key]
    return tree


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner``, except that every non-tensor item is read with ``torch.load(weights_only=True)``
    after :func:`check_item` (DCP's reads it with ``weights_only=False``: an item can run code). Tensors are read as
    DCP reads them. The arguments are ``DefaultLoadPlanner``'s. Pair it with :class:`SafeFileSystemReader`, which
    reads ``.metadata`` safely and checks the items before any tensor is read."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        check_item(value, f"item {fqn}")
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            *above, last = self.mappings[fqn]
            container_at(self.original_state_dict, above)[last] = loaded
        else:
            self.state_dict[fqn] = loaded


class _CheckedItems:
    """The planner of the reader's first pass: checks each pickled item and keeps its bytes for the real planner."""

    def __init__(self, where: str, storage_data: dict) -> None:
        self.where, self.storage_data, self.items = where, storage_data, []

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        stored = self.storage_data[read_item.storage_index]
        check_item(value, f"{self.where}/{stored.relative_path} (item {read_item.dest_index.fqn})")
        self.items.append((read_item, io.BytesIO(value.getvalue())))


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that reads a checkpoint as data: ``.metadata`` through :data:`ALLOWED_GLOBALS`,
    every storage path checked to stay inside the folder, and every pickled item checked (:func:`check_item`)
    before any tensor is read. ``dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=...)`` with
    :class:`SafeLoadPlanner` or ``ExactLoadPlanner``. The arguments are ``FileSystemReader``'s.

    The metadata is checked as soon as the reader is given its checkpoint (constructed, or ``reset`` to another
    by ``dcp.load(checkpoint_id=...)``), so that a refusal is raised by itself on every rank before DCP's first
    collective; DCP's own read of it (``read_metadata``, inside its planning, where it would report a refusal
    among other failures) goes through the same allow-list. A folder without ``.metadata`` is left for DCP to
    report."""

    def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._check_metadata()

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        self._check_metadata()

    def _check_metadata(self) -> None:
        path = self.fs.concat_path(self.path, METADATA_FILE)
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _unpickle_metadata(stream, str(path))
        except OSError:
            return  # no checkpoint here (yet): DCP's read says so in its own words
        self._check_paths(metadata)

    def _check_paths(self, metadata: Metadata) -> None:
        for relative in {getattr(stored, "relative_path", None) for stored in (metadata.storage_data or {}).values()}:
            if _escapes(relative, str(self.path)):
                raise UnsafeCheckpoint(
                    f"{self.path}/{METADATA_FILE} names the storage path {relative!r}, outside the checkpoint's "
                    "folder: refused"
                )

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self.fs.concat_path(self.path, METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _unpickle_metadata(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._check_paths(metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        pickled = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if not pickled:
            return super().read_data(plan, planner)
        checked = _CheckedItems(str(self.path), self.storage_data)
        super().read_data(dataclasses.replace(plan, items=pickled), checked).wait()  # all checked before a tensor
        tensors = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        done = super().read_data(dataclasses.replace(plan, items=tensors), planner)
        for item, value in checked.items:
            planner.load_bytes(item, value)
        return done
