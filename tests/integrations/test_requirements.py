"""The frameworks as users have them: tests/integrations/requirements.txt pins what the frameworks themselves
require (each pinned distribution's own requirements, read from the installed metadata, admit the other pins), the
installed versions are the pinned ones, and an integration whose framework does not import says in one line which
version it found and which it needs."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from optim_factory.integrations import SUPPORTED, framework_import_error
from tests.integrations import INSTALL

REQUIREMENTS = Path(__file__).with_name("requirements.txt")


def pins() -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return {canonicalize_name(name): version for name, version in (line.split("==") for line in lines if line)}


def test_every_pin_is_installed_as_pinned():
    missing = []
    for name, version in pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        assert installed == version, f"{name}: {installed} installed, {version} pinned"
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} ({INSTALL})")


def test_the_pins_satisfy_each_pinned_distribution_s_own_requirements():
    pinned = pins()
    for name in SUPPORTED:
        assert pinned[name].startswith(SUPPORTED[name] + "."), (
            f"{name} {pinned[name]} pinned, {SUPPORTED[name]} supported"
        )
    checked = 0
    for name in pinned:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            pytest.skip(f"{name} is not installed ({INSTALL})")
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an extra, or another platform's
            other = canonicalize_name(req.name)
            if other in pinned:
                checked += 1
                assert req.specifier.contains(pinned[other], prereleases=True), (
                    f"{name} requires {req}; requirements.txt pins {other}=={pinned[other]}"
                )
    assert checked >= 5, checked  # the frameworks' pinned requirements: spmd-types, tyro, transformers ...


FRAMEWORK_MODULES = [
    ("torchtitan", "torchtitan.components.optimizer"),
    ("nemo-automodel", "nemo_automodel.components.checkpoint.config"),
]


@pytest.mark.parametrize("distribution,module", FRAMEWORK_MODULES)
def test_a_framework_that_does_not_import_is_named_with_the_version_found_and_the_one_needed(distribution, module):
    pytest.importorskip(module, reason=f"{distribution} is not installed: {INSTALL}")
    with pytest.raises(ImportError) as info:
        exec(f"from {module} import NameThatNoReleaseHas")
    error = framework_import_error(distribution, info.value)
    line = str(error)
    assert "\n" not in line
    found = metadata.version(distribution)
    assert re.match(
        rf"optim_factory.integrations needs {distribution} {re.escape(SUPPORTED[distribution])}; "
        rf"{distribution} {re.escape(found)} is installed \(cannot import name 'NameThatNoReleaseHas'",
        line,
    ), line
