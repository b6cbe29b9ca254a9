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
    ],
    ids=[
        "top level",
        "guarded",
        "guarded the other way",
        "guarded with and",
        "main() guarded",
        "main() unguarded",
        "another if",
    ],
)
def test_the_line_a_call_runs_under_is_unguarded_only_outside_the_main_guard_s_body(tmp_path, script, unguarded_line):
    path = tmp_path / "script.py"
    path.write_text("from optim_factory.checkpoint._main_guard import unguarded_call\n" + textwrap.dedent(script))
    found = runpy.run_path(str(path), run_name="__main__")["FOUND"]
    assert found == (None if unguarded_line is None else f"{path}:{unguarded_line}")


def test_a_call_not_under_the_main_module_s_top_level_is_not_refused():
    assert unguarded_call() is None  # pytest's test call: its main module's top level is guarded, or not on the stack
