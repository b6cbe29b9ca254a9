"""help(optim_factory) lists the lazily imported FusedAdam (that the import stays lazy: tests/unit/test_te_guard.py)."""

from __future__ import annotations

import pydoc
from pathlib import Path

import optim_factory
from optim_factory.optimizers.te_fused_adam import FusedAdam

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_fused_adam_with_its_docstring():
    text = pydoc.render_doc(optim_factory, renderer=pydoc.plaintext)
    assert "class FusedAdam" in text
    first_line = FusedAdam.__doc__.strip().splitlines()[0]  # "``transformer_engine...FusedAdam`` plus the ..."
    assert first_line in text
    assert "class PortableFusedAdam" in text
    assert "FusedAdam" in dir(optim_factory)
