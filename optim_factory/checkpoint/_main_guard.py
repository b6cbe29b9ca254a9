"""Whether a child process started now from Python's forkserver (or spawn) would run the caller's script again.

Such a child imports the script's main module again, as ``__mp_main__``: its top level runs there once more, unless it
sits under ``if __name__ == "__main__":``. A writer process started from a save at the top level of an unguarded
script would run the script's training in the child (on one process, up to its own first save, where
multiprocessing refuses to start a process from a child still importing its main module), or wait in the child's
``init_process_group`` for ranks that never come (under torchrun, until the writer's start times out). The rule is
multiprocessing's own (``multiprocessing.spawn.get_preparation_data``): the main module is imported again by its
module name (``python -m``) unless it is a package's ``__main__``, else from its file; an interactive session or
``python -c`` has neither.
"""

from __future__ import annotations

import ast
import sys
import threading
from pathlib import Path

__all__ = ["unguarded_call"]


def unguarded_call() -> str | None:
    """``"<file>:<line>"`` of the main module's top-level line, outside ``if __name__ == "__main__":``, that the
    main thread runs (the caller's call, on the main thread) while a child would import that module again; else None
    (that line is under the guard, the main thread is not under the main module's top level, or no child imports the
    module again)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if path is None or name == "__main__" or name.endswith(".__main__"):
        return None
    frame = sys._current_frames().get(threading.main_thread().ident)  # the caller's own where it is the main thread
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals is vars(main) and frame.f_code.co_filename == path
    ):  # code exec'd with the main module's globals from another file (a wrapper's) is not its top level
        frame = frame.f_back
    if frame is None:
        return None
    try:
        tree = ast.parse(Path(path).read_bytes(), path)
    except (OSError, SyntaxError, ValueError):  # not readable as Python here: the child's import decides
        return None
    line = frame.f_lineno
    if any(_first_line(body) <= line <= (body[-1].end_lineno or line) for body in _guarded_bodies(tree)):
        return None
    return f"{path}:{line}"


def _guarded_bodies(tree: ast.AST):
    """The statement lists that run only where ``__name__ == "__main__"``: the body of ``if`` such a test (alone or
    one of an ``and``'s terms), the ``else`` of ``if __name__ != "__main__"``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            if _is_main_test(node.test, ast.Eq):
                yield node.body
            elif _is_main_test(node.test, ast.NotEq) and node.orelse:
                yield node.orelse


def _first_line(body: list[ast.stmt]) -> int:
    """The first line of a statement list: its first statement's decorators' where it has any."""
    first = body[0]
    return min([d.lineno for d in getattr(first, "decorator_list", [])] + [first.lineno])


def _is_main_test(test: ast.expr, op: type) -> bool:
    """``__name__ <op> "__main__"`` (either way round); with ``==``, also one of an ``and``'s terms."""
    if op is ast.Eq and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_main_test(value, op) for value in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], op)):
        return False
    sides = (test.left, test.comparators[0])
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
    )
