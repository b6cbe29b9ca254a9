"""A pytest plugin: each test's busy CPU-seconds of the whole machine (``/proc/stat``: every process, forked ranks
and daemons included) and its wall seconds, one line per test (CPU-s, wall s, test id) appended to
``$CPUPROF_OUT`` (default ``cpu_per_test.tsv`` in the working directory). Meaningful in one process with nothing
else running: ``PYTHONPATH=<this folder> python -m pytest -q -p cpuprof -p no:cacheprovider``."""

import os
import time

import pytest

_OUT = open(os.environ.get("CPUPROF_OUT", "cpu_per_test.tsv"), "a")  # noqa: SIM115  (open for the whole run)
_HZ = os.sysconf("SC_CLK_TCK")


def _busy() -> int:
    """Busy jiffies of every CPU since boot: the total less idle and iowait."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values) - values[3] - values[4]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy, start = _busy(), time.time()
    yield
    _OUT.write(f"{(_busy() - busy) / _HZ:.2f}\t{time.time() - start:.2f}\t{item.nodeid}\n")
    _OUT.flush()
