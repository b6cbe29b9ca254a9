"""optim_factory.checkpoint shows one face: its ``__init__`` is the whole API (every name of ``__all__`` resolves),
nothing in the library or the recipe reaches into its private modules, and the old ``optim_factory.async_save`` path
still works for one release with a ``DeprecationWarning`` naming the new one."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings

import optim_factory.checkpoint as face
from tests.unit.test_layout import ROOT, _imports, _modules


def test_every_name_of_the_face_resolves():
    assert face.__all__ and all(getattr(face, name, None) is not None for name in face.__all__)


def test_nothing_outside_the_package_imports_its_private_modules():
    modules = _modules()
    reaching = [
        f"{name}: {dep}"
        for name, path in modules.items()
        if not name.startswith("optim_factory.checkpoint")
        for dep, _ in _imports(name, path, modules)
        if dep.startswith("optim_factory.checkpoint._")
    ]
    assert reaching == []


def test_the_face_re_exports_and_defines_nothing_itself():
    tree = ast.parse((ROOT / "optim_factory" / "checkpoint" / "__init__.py").read_text())
    defined = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign)) and not (
        isinstance(n, ast.Assign) and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["__all__"]
    )]  # fmt: skip
    assert defined == []


def test_the_old_async_save_path_warns_and_gives_the_same_objects():
    sys.modules.pop("optim_factory.async_save", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("optim_factory.async_save")
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        "optim_factory.async_save is deprecated and will be removed in the next release: "
        "import its names (AsyncSaveStager, SaveRefused ...) from optim_factory.checkpoint"
    ]
    assert old.__all__ and all(getattr(old, name) is getattr(face, name) for name in old.__all__)


def test_the_checkpoint_package_reaches_the_export_through_its_face():
    """The export's hooks a save uses (its stream items, host buffers, pinning) are the export package's public names:
    nothing in optim_factory.checkpoint imports one of its modules directly."""
    modules = _modules()
    reaching = [
        f"{name}: {dep}"
        for name, path in modules.items()
        if name.startswith("optim_factory.checkpoint")
        for dep, _ in _imports(name, path, modules)
        if dep.startswith("optim_factory.optimizers.export.")
    ]
    assert reaching == []
