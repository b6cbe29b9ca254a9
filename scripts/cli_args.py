"""argparse types shared by the scripts: a bad value is refused when the arguments are parsed, before any
measurement runs, with argparse's one error line naming the option (exit 2). Unchecked, ``--repeats 0`` would end
a benchmark in a traceback (an empty median) and an ``--out`` that is a file would lose its results at the end."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

__all__ = [
    "HelpFormatter",
    "positive_int",
    "non_negative_int",
    "positive_float",
    "out_dir",
    "out_file",
    "in_file",
    "device",
    "require_te",
]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help``: the module docstring as written, and each option's default."""


def _number(text: str, kind: type, minimum: float, what: str) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not value >= minimum or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(text, int, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    value = _number(text, float, 0, "a positive number")
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _writable_ancestor(path: Path, text: str) -> None:
    """The nearest existing folder above ``path`` must be a folder this process may write into."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not writable")


def out_dir(text: str) -> Path:
    """A directory to write into: an existing one, or one that can be created."""
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{text} is not writable")
        return path
    _writable_ancestor(path, text)
    return path


def out_file(text: str) -> Path:
    """A file to write: not a directory, in a directory that exists or can be created."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, expected a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    _writable_ancestor(path, text)
    return path


def device(text: str) -> torch.device:
    """A torch device this machine has (``cuda`` on a machine without CUDA is refused here, not by a traceback from
    the first allocation)."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this torch ({torch.__version__}) sees no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def require_te(ap: argparse.ArgumentParser, option: str) -> None:
    """Refuse ``option`` (which asks for TE's class) in one line where Transformer Engine cannot be imported."""
    from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE, te_import_error

    if not TE_AVAILABLE:
        ap.error(f"{option} needs Transformer Engine, which does not import here ({te_import_error()}): use portable")


def in_file(text: str) -> Path:
    """A file to read: it exists and is a file."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {'not a file' if path.exists() else 'no such file'}")
    return path
