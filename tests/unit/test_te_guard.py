"""The TE subclass without Transformer Engine: clean import, one clear error, shared export code."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import optim_factory
from optim_factory.optimizers import export, te_fused_adam


@pytest.mark.skipif(te_fused_adam.TE_AVAILABLE, reason="Transformer Engine is installed here")
def test_constructing_without_te_raises_one_clear_error():
    with pytest.raises(ImportError) as info:
        optim_factory.FusedAdam([torch.nn.Parameter(torch.zeros(2))], state_dict_cpu_offload=True)
    message = str(info.value)
    assert "\n" not in message
    assert "transformer_engine" in message and "PortableFusedAdam" in message and "pip install" in message


@pytest.mark.slow  # a fresh interpreter
def test_package_imports_without_pulling_in_te_and_loads_the_te_module_only_when_fused_adam_is_used():
    code = (
        "import sys, optim_factory; "
        "assert 'transformer_engine' not in sys.modules, 'TE imported'; "
        "assert 'optim_factory.optimizers.te_fused_adam' not in sys.modules, 'imported eagerly'; "
        "optim_factory.FusedAdam; "
        "assert 'optim_factory.optimizers.te_fused_adam' in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_both_backends_share_one_export_path():
    assert issubclass(te_fused_adam.FusedAdam, export.OffloadedStateDict)
    assert issubclass(optim_factory.PortableFusedAdam, export.OffloadedStateDict)
    for name in ("load_state_dict", "release_state_dict"):  # one implementation, not overridden
        assert getattr(te_fused_adam.FusedAdam, name) is getattr(export.OffloadedStateDict, name)
        assert getattr(optim_factory.PortableFusedAdam, name) is getattr(export.OffloadedStateDict, name)
    assert optim_factory.FusedAdam is te_fused_adam.FusedAdam
    import inspect

    options = {
        "state_dict_cpu_offload": False,
        "state_dict_offload_chunk_bytes": None,
        "state_dict_offload_reuse_buffers": False,
    }
    for cls in (te_fused_adam.FusedAdam, optim_factory.PortableFusedAdam):
        sig = inspect.signature(cls.__init__)
        for name, default in options.items():
            assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
            assert sig.parameters[name].default is default
