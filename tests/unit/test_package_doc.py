"""help(optim_factory) lists the lazily imported FusedAdam, and `import optim_factory` stays lazy about it."""

from __future__ import annotations

import pydoc
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow  # a fresh interpreter
def test_import_does_not_load_the_te_module_until_fused_adam_is_used():
    code = (
        "import sys, optim_factory; "
        "assert 'optim_factory.optimizers.te_fused_adam' not in sys.modules, 'imported eagerly'; "
        "optim_factory.FusedAdam; "
        "assert 'optim_factory.optimizers.te_fused_adam' in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
