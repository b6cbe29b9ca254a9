"""The one walker over nested state dicts (dicts, lists and tuples of tensors and plain values)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["host_storages", "leaves", "local_tensors", "map_leaves", "state_bytes"]


def leaves(tree: Any, path: tuple = (), *, dicts_only: bool = False) -> Iterator[tuple[tuple, Any]]:
    """(path of keys and indices, value) of every leaf, depth first, in the containers' order; ``dicts_only``:
    lists and tuples are leaves."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, (*path, k), dicts_only=dicts_only)
    elif isinstance(tree, (list, tuple)) and not dicts_only:
        for i, v in enumerate(tree):
            yield from leaves(v, (*path, i))
    else:
        yield path, tree


def map_leaves(fn: Callable[[tuple, Any], Any], tree: Any, path: tuple = ()) -> Any:
    """The same dicts and lists with every leaf replaced by ``fn(path, leaf)``; a tuple is a leaf (a group's
    ``betas``, a namedtuple: passed to ``fn`` whole)."""
    if isinstance(tree, dict):
        return {k: map_leaves(fn, v, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(fn, v, (*path, i)) for i, v in enumerate(tree)]
    return fn(path, tree)


def local_tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of ``tree`` (the local shard of a DTensor), depth first."""
    import torch  # here, not at the top: the command line walks configs with leaves() before torch is imported

    # the local tensor itself: with grad on, to_local() is an autograd Function call per DTensor; one no_grad block for
    # the whole walk (a save's walks meet every tensor it writes: a block per DTensor took a quarter of their time)
    found: list[torch.Tensor] = []
    with torch.no_grad():
        for _, v in leaves(tree):
            if isinstance(v, torch.Tensor):
                found.append(v.to_local() if hasattr(v, "to_local") else v)
    return found


def state_bytes(tree: Any) -> int:
    """Bytes of the (local shards of the) tensors in a nested state dict."""
    return sum(t.numel() * t.element_size() for t in local_tensors(tree))


def host_storages(tree: Any) -> dict[int, int]:
    """The host memory that the tensors of ``tree`` (local shards of DTensors) hold: each CPU storage once, whole
    (views of one buffer share it), its address -> its bytes."""
    found: dict[int, int] = {}
    for t in local_tensors(tree):
        if t.device.type == "cpu" and not t.is_meta:
            storage = t.untyped_storage()  # one storage object a tensor (each call makes a new one)
            found[storage.data_ptr()] = storage.nbytes()
    return found
