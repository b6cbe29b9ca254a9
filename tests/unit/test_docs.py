"""The documentation stays true to the code: docs/recipe.md's option table is the schema's, README's test
command is CI's, and every relative link in README.md and docs/ names a file that exists."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import subprocess
import typing
from enum import Enum
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from optim_factory.config import DEFAULT_NO_DECAY, AdamWConfig, FusedAdamConfig, schema_keys

ROOT = Path(__file__).resolve().parents[2]

# Defaults a table cell describes in words instead of spelling: (the schema's value, the cell's words).
DESCRIBED = {"param_groups.no_decay": (DEFAULT_NO_DECAY, "biases, `*norm*`, `ln_*`, `*embed*`")}


def _option_rows() -> dict[str, str]:
    """docs/recipe.md's option table: key -> its default cell (a row naming two keys gives both)."""
    text = (ROOT / "docs" / "recipe.md").read_text()
    start = text.index("| key | default")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        for key in re.findall(r"`([\w.]+)`", cells[0]):
            rows[key] = cells[1]
    return rows


def _leaf_keys(schema: type) -> dict[str, typing.Any]:
    """Dotted keys of a schema whose value is not itself a schema, with their defaults."""
    out = {}
    for key in schema_keys(schema):
        node: typing.Any = schema()
        for part in key.split("."):
            node = getattr(node, part)
        if not dataclasses.is_dataclass(node):
            out[key] = node
    return out


def _yaml_value(cell: str) -> typing.Any:
    """The first backticked value of a cell, read as YAML 1.2 reads it (``1e-3`` is a float)."""
    literal = re.match(r"`([^`]*)`", cell).group(1)
    if literal.startswith("["):
        return json.loads(literal)
    try:
        return float(literal)
    except ValueError:
        return {"true": True, "false": False, "null": None}.get(literal, literal)


def _plain(value: typing.Any) -> typing.Any:
    return value.value if isinstance(value, Enum) else value


def test_option_table_is_the_schemas():
    rows = _option_rows()
    fused, adamw = _leaf_keys(FusedAdamConfig), _leaf_keys(AdamWConfig)
    expected = fused | {k: v for k, v in adamw.items() if k not in fused}
    assert sorted(rows) == sorted(expected), "docs/recipe.md's option table and the schemas name different keys"
    for key, cell in rows.items():
        if key in DESCRIBED:
            value, words = DESCRIBED[key]
            assert expected[key] == value and cell == words, f"{key}: update the described default"
            continue
        assert _yaml_value(cell) == _plain(expected[key]), f"{key}: docs say {cell}, the schema {expected[key]!r}"


def test_option_table_names_what_the_recipes_yaml_sets():
    """A cell's ``(value)`` is conf/optim/fused_adam.yaml's where it differs; no other key is set there."""
    rows = _option_rows()
    recipe = yaml.safe_load((ROOT / "conf" / "optim" / "fused_adam.yaml").read_text())
    set_keys = {k for k in recipe if k not in ("defaults", "name")}
    documented = {k for k, cell in rows.items() if re.search(r"\(`", cell)}
    assert documented == set_keys
    for key in set_keys:
        assert _yaml_value(re.search(r"\((`[^`]*`)", rows[key]).group(1)) == recipe[key], key


def test_readme_test_command_is_cis():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# README test command:") + 1]
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert block[1] == command
    assert block[0].endswith("python recipes/train.py")


def test_readme_python_blocks_run(monkeypatch, tmp_path):
    """Every Python block of the README runs as written, as ``torchrun --nproc_per_node=1`` would run it (the
    torchrun variables set; in this process, which has no process group of its own up)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    assert not dist.is_initialized()
    monkeypatch.chdir(tmp_path)  # where the blocks write
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(name, value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), {"__name__": "__main__"})
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def test_relative_links_resolve():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    broken = []
    for path in files:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken
    assert len(files) >= 9


def test_every_drop_in_block_runs_in_a_test_and_framework_commands_are_marked_gpu():
    """docs/drop-in.md: each fenced block follows a ``<!-- drop-in:<name> -->`` marker that a test under tests/
    reads by name (the tests run the blocks as written); the frameworks' own launch commands, which need CUDA,
    are marked as GPU commands."""
    doc = (ROOT / "docs" / "drop-in.md").read_text()
    lines = doc.splitlines()
    openings = [i for i, line in enumerate(lines) if re.fullmatch(r"```[a-z]+", line)]
    assert openings
    sources = "".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    for i in openings:
        marker = re.fullmatch(r"<!-- drop-in:([\w-]+) -->", lines[i - 1])
        assert marker, f"docs/drop-in.md:{i + 1}: a block without a drop-in marker"
        assert f'"{marker.group(1)}"' in sources, f"no test reads the block {marker.group(1)}"
    for command in ("`automodel recipe.yaml`", "`torchrun ... -m torchtitan.train`"):
        paragraph = next(p for p in doc.split("\n\n") if command in p)
        assert "**GPU command**" in paragraph, command


def test_results_keep_at_most_12_runs_each_on_the_summary_page_and_the_readme_at_most_125_lines():
    """benchmarks/results/ keeps the newest and most cited runs, at most 12 (older ones live in git history, as the
    summary page says); the summary page links every run kept; the README stays a page (125 lines at most)."""
    results = ROOT / "benchmarks" / "results"
    runs = sorted(p.name for p in results.iterdir() if p.is_dir())
    assert len(runs) <= 12, runs
    summary = (results / "README.md").read_text()
    assert [r for r in runs if f"]({r}/)" not in summary] == []
    assert "git show <commit>^:benchmarks/results/<folder>/README.md" in summary
    assert len((ROOT / "README.md").read_text().splitlines()) <= 125


def test_the_slurm_scripts_cite_only_files_of_the_repository():
    """A file path named in scripts/slurm/ (a README, a script, a config) is one a clone has, inside it (a file
    beside the clone, such as ../shared/..., exists on one machine only)."""
    cited = {
        f"{script.name}: {name}"
        for script in sorted((ROOT / "scripts" / "slurm").iterdir())
        for name in re.findall(r"[\w./-]+\.(?:md|sh|py|yaml|sbatch)\b", script.read_text())
        if "/" in name and not ((ROOT / name).is_file() and (ROOT / name).resolve().is_relative_to(ROOT))
    }
    assert not cited


def test_the_sbatch_scripts_log_is_ignored_by_git():
    """scripts/slurm/train.sbatch's ``--output`` file, which lands in the directory sbatch ran in (the repository,
    as docs/multi-node.md shows it), is one git ignores: it does not show as an untracked file."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    output = re.search(r"^#SBATCH --output=(\S+)$", (ROOT / "scripts/slurm/train.sbatch").read_text(), re.M).group(1)
    log = output.replace("%x", "optim-factory").replace("%j", "12345")
    assert "/" not in log  # in the directory sbatch ran in
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", log], cwd=ROOT)
    assert ignored.returncode == 0, f"{log} is not ignored by .gitignore"
