"""A writer process (``StagerOptions(write_in_process=True)``) imports the script's main module again: a save started
from an unguarded top level is refused in one line naming that line, before anything is staged or started, instead of
the script running again in the child (``optim_factory/checkpoint/_main_guard.py``). The scripts run in this process
as ``__main__`` (``runpy.run_path``), as ``python script.py`` runs them."""

from __future__ import annotations

import runpy
import textwrap

import pytest

from optim_factory.checkpoint._main_guard import unguarded_call

SAVE = """
import torch
from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import AsyncSaveStager, StagerOptions

model = torch.nn.Linear(4, 4)
opt = PortableFusedAdam(model.parameters(), lr=1e-3, state_dict_cpu_offload=True)
stager = AsyncSaveStager(opt, StagerOptions(write_in_process=True))
try:
    stager.async_save({"model": model.state_dict()}, checkpoint_id=CHECKPOINT)
finally:
    stager.close()
"""


def test_a_save_from_the_unguarded_top_level_of_a_script_is_refused_naming_its_line(tmp_path):
    script, checkpoint = tmp_path / "train.py", tmp_path / "ck"
    script.write_text(SAVE.replace("CHECKPOINT", repr(str(checkpoint))))
    line = SAVE.splitlines().index('    stager.async_save({"model": model.state_dict()}, checkpoint_id=CHECKPOINT)') + 1
    with pytest.raises(RuntimeError) as refused:
        runpy.run_path(str(script), run_name="__main__")
    assert str(refused.value) == (
        "AsyncSaveStager(StagerOptions(write_in_process=True)): the writer process would run this script again: "
        f'{script}:{line} is outside `if __name__ == "__main__":`; put the script\'s top level under it'
    )
    assert not checkpoint.exists()


@pytest.mark.parametrize(
    "script, unguarded_line",
    [
        ("FOUND = unguarded_call()", 2),
        ('if __name__ == "__main__":\n    FOUND = unguarded_call()', None),
        ('if "__main__" == __name__:\n    FOUND = unguarded_call()', None),
        ('import os\nif os.sep and __name__ == "__main__":\n    FOUND = unguarded_call()', None),
        ("def main():\n    return unguarded_call()\nif __name__ == '__main__':\n    FOUND = main()", None),
        ("def main():\n    return unguarded_call()\nFOUND = main()", 4),
        ('import os\nif os.sep:\n    FOUND = unguarded_call()\nif __name__ == "__main__":\n    pass', 4),
        ('if __name__ != "__main__":\n    pass\nelse:\n    FOUND = unguarded_call()', None),
        (
            "def deco(fn):\n    global FOUND\n    FOUND = unguarded_call()\n    return fn\n"
            'if __name__ == "__main__":\n    @deco\n    def f():\n        pass',
            None,
        ),
    ],
    ids=[
        "top level",
        "guarded",
        "guarded the other way",
        "guarded with and",
        "main() guarded",
        "main() unguarded",
        "another if",
        "else of !=",
        "a decorator",
    ],
)
def test_the_line_a_call_runs_under_is_unguarded_only_outside_the_main_guard_s_body(tmp_path, script, unguarded_line):
    path = tmp_path / "script.py"
    path.write_text("from optim_factory.checkpoint._main_guard import unguarded_call\n" + textwrap.dedent(script))
    found = runpy.run_path(str(path), run_name="__main__")["FOUND"]
    assert found == (None if unguarded_line is None else f"{path}:{unguarded_line}")


def test_a_call_not_under_the_main_module_s_top_level_is_not_refused():
    assert unguarded_call() is None  # pytest's test call: its main module's top level is guarded, or not on the stack


def test_a_call_on_another_thread_is_judged_by_the_line_the_main_thread_runs(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(
        "import threading\n"
        "from optim_factory.checkpoint._main_guard import unguarded_call\n"
        "FOUND = []\n"
        "thread = threading.Thread(target=lambda: FOUND.append(unguarded_call()))\n"
        "thread.start(); thread.join()\n"
    )
    assert runpy.run_path(str(path), run_name="__main__")["FOUND"] == [f"{path}:5"]


def test_code_exec_d_from_another_file_is_judged_by_the_main_module_s_own_line(tmp_path):
    """A guarded wrapper that runs another file's code with its globals: the child runs the wrapper again, not the
    other file."""
    other, wrapper = tmp_path / "train.py", tmp_path / "wrapper.py"
    # its call on a line past the wrapper's guard: read against the wrapper's file, it would be outside it
    other.write_text(
        "from optim_factory.checkpoint._main_guard import unguarded_call\n\n\n\nFOUND = unguarded_call()\n"
    )
    wrapper.write_text(
        f'if __name__ == "__main__":\n    exec(compile(open({str(other)!r}).read(), {str(other)!r}, "exec"))\n'
    )
    assert runpy.run_path(str(wrapper), run_name="__main__")["FOUND"] is None


@pytest.mark.parametrize("main, unguarded", [("mod", True), ("__main__", False)])
def test_python_m_imports_a_module_again_but_not_a_package_s_main(tmp_path, monkeypatch, main, unguarded):
    name = f"pkg_guard_{main.strip('_')}"  # a package of its own per case: imported packages stay in sys.modules
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / f"{main}.py").write_text(
        "from optim_factory.checkpoint._main_guard import unguarded_call\nFOUND = unguarded_call()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = name if main == "__main__" else f"{name}.{main}"
    found = runpy.run_module(module, run_name="__main__", alter_sys=True)["FOUND"]
    assert found == (f"{package / (main + '.py')}:2" if unguarded else None)
