"""Does the test suite catch these mutations? Each is one textual change to the code at a git revision; the suite
runs once per mutation (``-x``: the first failing test is enough), in a copy of that revision.

    python benchmarks/mutants.py --rev HEAD --out benchmarks/results/<folder>/mutants-HEAD.md [-- pytest args]
    python benchmarks/mutants.py --only lowmem -- tests/unit/test_factory.py   # the mutations whose name has "lowmem"

A mutation whose text is not found exactly once at that revision is reported as not applicable. The list and the
results of the last measurement: docs/testing.md ("Mutations").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, file, text, replacement)
MUTANTS = [
    (
        "capturable step ignores its group's lr tensor (steps with the scheduler's initial lr)",
        "optim_factory/optimizers/updates.py",
        '    lr = group["lr"]\n    lr = lr.to(',
        '    lr = group["lr"]\n'
        '    lr = torch.as_tensor(group.get("initial_lr", lr)) if isinstance(lr, torch.Tensor) else lr\n'
        "    lr = lr.to(",
    ),
    (
        "eps inside the square root",
        "optim_factory/optimizers/kernel_math.py",
        "    denom = sqrt(v * rcp(bc2)) + eps\n",
        "    denom = sqrt(v * rcp(bc2) + eps)\n",
    ),
    (
        "AdamW's decoupled weight decay dropped",
        "optim_factory/optimizers/kernel_math.py",
        "        update = fma(p, decay, update)\n",
        "        update = update\n",
    ),
    (
        "streamed export forgets the per-tensor scale (FP16/FP8 states)",
        "optim_factory/optimizers/export/stream.py",
        "    if piece.item.scale is not None:\n        out.mul_(piece.item.scale)",
        "    if False:\n        out.mul_(piece.item.scale)",
    ),
    (
        "state_dict_keep_bf16 ignored by the streamed export (BF16 exported as FP32)",
        "optim_factory/optimizers/export/plan.py",
        "kept = source.dtype == torch.int16 or (self.options.keep_bf16 and bf16)",
        "kept = source.dtype == torch.int16",
    ),
    (
        "load_state_dict takes NaN/inf states",
        "optim_factory/optimizers/export/contract.py",
        "    if not all_finite(t for _, t in checked):",
        "    if False:",
    ),
    (
        "load_state_dict takes a negative exp_avg_sq",
        "optim_factory/optimizers/export/contract.py",
        "    if not all_non_negative(t for _, t in second):",
        "    if False:",
    ),
    (
        "int16 remainders loaded into the FP32 master of an FP16 parameter",
        "optim_factory/optimizers/export/contract.py",
        "param.dtype != torch.bfloat16 and optimizer.master_weights",
        "param.dtype == torch.float32 and optimizer.master_weights",
    ),
    (
        "verification ignores a checksum mismatch",
        "recipes/checkpoint/checksums.py",
        "    if digest != record.get(ALGORITHM):",
        "    if False:",
    ),
    (
        "keep_last keeps one checkpoint too many",
        "recipes/checkpoint/layout.py",
        "done[: max(0, len(done) - keep_last)]",
        "done[: max(0, len(done) - keep_last - 1)]",
    ),
    (
        "keep_last may delete the newest verified checkpoint",
        "recipes/checkpoint/layout.py",
        "if verified is not None and path.resolve() == verified.resolve():",
        "if False:",
    ),
    (
        "a capturable optimizer's step/lr exported as the live tensors with state_dict_offload_chunk_bytes=0",
        "optim_factory/optimizers/export/plan.py",
        '        if o.cpu_offload:\n            state_dict["param_groups"] = [',
        '        if o.chunk_bytes:\n            state_dict["param_groups"] = [',
    ),
    (
        "nested deferred_state_dict() blocks are not re-entrant (the inner one's end stops the outer one deferring)",
        "optim_factory/optimizers/export/mixin.py",
        "            self._deferring -= 1",
        "            self._deferring = 0",
    ),
    (
        "defers_export says yes for a background export into fresh buffers (reuse off)",
        "optim_factory/checkpoint/_deferral.py",
        "        and optimizer.state_dict_offload_background\n        and optimizer.state_dict_offload_reuse_buffers",
        "        and optimizer.state_dict_offload_background",
    ),
    (
        "release_state_dict returns while the background export still writes the buffers it releases",
        "optim_factory/optimizers/export/mixin.py",
        "        self._exporter.join()\n        return self._exporter.pool.release(state_dict)",
        "        return self._exporter.pool.release(state_dict)",
    ),
    (
        "torchtitan's use_fused_adam lets the config's group hyperparameters override the options given",
        "optim_factory/integrations/torchtitan.py",
        "optimizer_kwargs={**pg.optimizer_kwargs, **group}",
        "optimizer_kwargs={**group, **pg.optimizer_kwargs}",
    ),
    (
        "torchtitan's use_fused_adam lets the config's constructor options override the options given",
        "optim_factory/integrations/torchtitan.py",
        "by_name[name] = {**by_name.get(name, {}), **factory}",
        "by_name[name] = {**factory, **by_name.get(name, {})}",
    ),
    (
        "torchtitan's use_fused_adam swaps Adam (L2) groups into decoupled weight decay",
        "optim_factory/integrations/torchtitan.py",
        '        if pg.optimizer_name == "AdamW"\n        else pg',
        '        if pg.optimizer_name in ("AdamW", "Adam")\n        else pg',
    ),
    (
        "Automodel's Checkpointer ignores a caller's storage_reader for the optimizer",
        "optim_factory/integrations/automodel.py",
        "            storage_reader=storage_reader,\n            planner=ExactLoadPlanner(),",
        "            planner=ExactLoadPlanner(),",
    ),
    (
        "Automodel's Checkpointer reads the optimizer given a storage_reader with DCP's default planner",
        "optim_factory/integrations/automodel.py",
        "        if not optimizer or (storage_reader is None and not local):",
        "        if not optimizer or storage_reader is not None or not local:",
    ),
    (
        "the rule refusing capturable with store_param_remainders skipped without master weights",
        "optim_factory/rules/adam.py",
        "        if store_param_remainders:\n            raise ConfigError(",
        "        if store_param_remainders and master_weights:\n            raise ConfigError(",
    ),
    (
        "the recipe's save verdict not shared across ranks (a synchronous or async save's check)",
        "recipes/checkpoint/save.py",
        "        worst = max(all_ranks(verdict))",
        "        worst = max(all_ranks(verdict)) if path is not None else verdict",
    ),
    (
        "fallback sets aside (.damaged) a checkpoint that failed to load without damage",
        "recipes/checkpoint/load.py",
        "                if isinstance(exc, DamagedCheckpoint):\n                    damaged.append(path)",
        "                if isinstance(exc, CheckpointError):\n                    damaged.append(path)",
    ),
    (
        "optim=adamw optim.amsgrad=true builds AdamW without amsgrad",
        "optim_factory/factory.py",
        "weight_decay=c.weight_decay, amsgrad=c.amsgrad)",
        "weight_decay=c.weight_decay)",
    ),
    (
        "the lowmem preset without int16 remainders (a full FP32 master kept)",
        "conf/optim/fused_adam_lowmem.yaml",
        "store_param_remainders: true\n",
        "",
    ),
]


def _export(rev: str, dest: Path) -> None:
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def run(rev: str, pytest_args: list[str], only: str = "") -> list[dict]:
    rows = []
    for name, file, text, replacement in MUTANTS:
        if only not in name:
            continue
        with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
            tree = Path(tmp)
            _export(rev, tree)
            path = tree / file
            source = path.read_text() if path.exists() else ""
            if source.count(text) != 1:
                rows.append(dict(name=name, file=file, result="not applicable", seconds=0.0, first_failure=""))
                continue
            path.write_text(source.replace(text, replacement))
            env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *pytest_args]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            # pytest's summary lines ("FAILED tests/...::name"), not a captured log line that starts with ERROR
            failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED tests/", "ERROR tests/"))]
            result = "caught" if proc.returncode == 1 and failed else "missed" if proc.returncode == 0 else "error"
            if result == "error":
                failed = [proc.stdout[-300:] + proc.stderr[-300:]]
            rows.append(dict(name=name, file=file, result=result, seconds=seconds, first_failure=(failed or [""])[0]))
        print(f"{rows[-1]['result']:>14}  {name}  ({rows[-1]['seconds']:.0f} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD", help="the git revision to mutate (default: HEAD)")
    ap.add_argument("--out", type=Path, help="a Markdown table of the results")
    ap.add_argument("--only", default="", help="only the mutations whose name contains this text")
    ap.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT, capture_output=True, text=True)
    rows = run(args.rev, args.pytest_args, args.only)
    caught = sum(r["result"] == "caught" for r in rows)
    lines = [
        f"# Mutations at {commit.stdout.strip()}: {caught} of {len(rows)} caught",
        "",
        f"- command: `python benchmarks/mutants.py --rev {args.rev}{f' --only {args.only!r}' if args.only else ''} "
        f"-- {' '.join(args.pytest_args)}`",
        f"- date: {time.strftime('%Y-%m-%d')}",
        "",
        "| mutation | file | result | first failing test | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        first = r["first_failure"].replace("|", "\\|")[:160]
        lines.append(f"| {r['name']} | `{r['file']}` | {r['result']} | {first} | {r['seconds']:.0f} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
