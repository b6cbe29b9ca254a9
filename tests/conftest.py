"""Suite-wide test configuration.

The README's command runs the suite on two pytest-xdist workers, a test file to a worker (``-n 2 --dist
loadfile``: a module's fixtures, such as the local Slurm cluster of tests/recipe/test_slurm.py, live in one
process). The tests marked ``slow`` (each starts processes of its own) come first, so that their files are handed
out before the quick ones and no long file is left running alone at the end.

Once every test module is imported, the suite's process freezes what the imports made out of the garbage collector
(``gc.freeze``), as a long-lived owner of its collector would: the recipe's loop then leaves the collector to it
(``recipes.job.setup_frozen``) instead of collecting the whole heap at every in-process run. Tests of the loop's
own policy start from a fresh interpreter's collector (the ``unowned_collector`` fixture).

The tests' temporary directories are made in memory, in ``/dev/shm`` where it is a tmpfs with 8 GiB free: the
checkpoints the tests write are then not flushed to a disk at every ``fsync`` that DCP's writer and the recipe make
(docs/testing.md, "Temporary directories in memory", for what it saves and holds). A passed test's ``tmp_path`` is
removed when the test ends (pyproject.toml's ``tmp_path_retention_policy``); the directories of module- and
session-scoped fixtures (``tmp_path_factory``) stay until the run ends, and a green run leaves nothing. ``--basetemp``
or ``PYTEST_DEBUG_TEMPROOT`` put them elsewhere.
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
_MEMORY_TEMP_ROOM = 8 << 30  # free room it must have (docs/testing.md: what the suite holds there)


def _is_tmpfs(mount_point: str) -> bool:
    try:
        with open("/proc/mounts") as mounts:
            return any(fields[1:3] == [mount_point, "tmpfs"] for fields in map(str.split, mounts))
    except OSError:  # not Linux
        return False


def _temp_in_memory(config) -> None:
    if config.option.basetemp or "PYTEST_DEBUG_TEMPROOT" in os.environ or not _is_tmpfs(_MEMORY_TEMP_ROOT):
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
