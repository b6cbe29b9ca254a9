"""Suite-wide test configuration.

The suite runs on two pytest-xdist workers, a test file to a worker (``-n 2 --dist loadfile``: a module's
fixtures, such as the local Slurm cluster of tests/recipe/test_slurm.py, live in one process). Where a run holds
tests marked ``slow`` and others (the whole suite; CI runs ``-m "not slow"``), the slow ones come first, so that
their files are handed out before the quick ones and no long file is left running alone at the end.

Once every test module is imported, the suite's process freezes what the imports made out of the garbage collector
(``gc.freeze``), as a long-lived owner of its collector would: the recipe's loop then leaves the collector to it
(``recipes.job.setup_frozen``) instead of collecting the whole heap at every in-process run. Tests of the loop's
own policy start from a fresh interpreter's collector (the ``unowned_collector`` fixture).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # in one process the order stays the files' (unit tests first)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the slow ones first


def pytest_configure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each (no OpenMP spinning),
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # and in the processes they start (forked ones too)


def pytest_collection_finish(session) -> None:
    gc.collect()
    gc.freeze()


@pytest.fixture
def unowned_collector():
    """Nothing frozen during the test, as in a fresh interpreter; the suite's freeze again after it."""
    gc.unfreeze()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
