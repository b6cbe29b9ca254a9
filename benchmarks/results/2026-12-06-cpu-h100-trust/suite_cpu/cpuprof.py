import os, time, pytest
def _busy():
    with open("/proc/stat") as f:
        p = f.readline().split()[1:]
    v = list(map(int, p))
    idle = v[3] + v[4]
    return sum(v) - idle
_out = open(os.environ.get("CPUPROF_OUT", "/tmp/s14/prof/cpu.tsv"), "a")
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    b, t = _busy(), time.time()
    yield
    hz = os.sysconf("SC_CLK_TCK")
    _out.write(f"{(_busy()-b)/hz:.2f}\t{time.time()-t:.2f}\t{item.nodeid}\n"); _out.flush()
