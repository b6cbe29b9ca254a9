"""Suite-wide test configuration.

The README's command runs the suite on two pytest-xdist workers, a test file to a worker (``-n 2 --dist
loadfile``: a module's fixtures, such as the local Slurm cluster of tests/recipe/test_slurm.py, live in one
process). The tests marked ``slow`` (each starts processes of its own) come first, so that their files are handed
out before the quick ones and no long file is left running alone at the end.

Once every test module is imported, the suite's process freezes what the imports made out of the garbage collector
(``gc.freeze``), as a long-lived owner of its collector would: the recipe's loop then leaves the collector to it
(``recipes.job.setup_frozen``) instead of collecting the whole heap at every in-process run. Tests of the loop's
own policy start from a fresh interpreter's collector (the ``unowned_collector`` fixture).

The tests' temporary directories are made in memory (``/dev/shm``) where it is a tmpfs with room for them: the
checkpoints the tests write are then not flushed to a disk by every ``fsync`` that DCP's writer and the recipe make
(the suite on two workers: 387 s against 430 s, back to back). A passed test's directory is removed when it ends
(pyproject.toml's ``tmp_path_retention_policy``), so the memory they take is that of the tests running;
``--basetemp`` or ``PYTEST_DEBUG_TEMPROOT`` choose another place.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # in one process the order stays the files' (unit tests first)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the slow ones first


_MEMORY_TEMP_ROOT = "/dev/shm"
_MEMORY_TEMP_ROOM = 8 << 30  # the room it must have: the suite on two workers held at most 1.4 GiB there


def _temp_in_memory(config) -> None:
    if config.option.basetemp or "PYTEST_DEBUG_TEMPROOT" in os.environ or not os.path.ismount(_MEMORY_TEMP_ROOT):
        return
    room = os.statvfs(_MEMORY_TEMP_ROOT)
    if room.f_bavail * room.f_frsize >= _MEMORY_TEMP_ROOM and os.access(_MEMORY_TEMP_ROOT, os.W_OK):
        os.environ["PYTEST_DEBUG_TEMPROOT"] = _MEMORY_TEMP_ROOT  # read when the first temporary directory is made


def pytest_configure(config) -> None:
    _temp_in_memory(config)
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
