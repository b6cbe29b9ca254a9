"""GPU tests: need CUDA and Transformer Engine; skipped (with the reason) otherwise; never part of CI.

Run on a GPU machine with TE:  python -m pytest -q tests/gpu   (2-rank tests need 2 GPUs).
Set GPU_RESULTS=<file.jsonl> to append the measured numbers (memory peaks, deviations) to a file.
"""

from __future__ import annotations

import json
import os

import pytest
import torch


def _te_status() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE, te_import_error

    if not TE_AVAILABLE:
        return f"Transformer Engine not importable ({te_import_error()})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _te_status()
    for item in items:
        if "tests/gpu/" not in str(item.fspath).replace(os.sep, "/"):
            continue
        item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("cuda_only") and torch.cuda.is_available():
            continue  # needs CUDA, not Transformer Engine
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))
        elif item.get_closest_marker("two_gpus") and torch.cuda.device_count() < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 GPUs"))


def pytest_configure(config):
    config.addinivalue_line("markers", "two_gpus: needs 2 CUDA devices")
    config.addinivalue_line("markers", "cuda_only: needs CUDA but not Transformer Engine")


@pytest.fixture
def record():
    """Append one JSON record of measurements to $GPU_RESULTS (if set) and return it."""

    def _record(**fields):
        path = os.environ.get("GPU_RESULTS")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(fields, default=str) + "\n")
        return fields

    return _record
