"""What a changed master format does through DCP, with DCP's default planner and with ``ExactLoadPlanner``.

One process, CPU, ``PortableFusedAdam`` on BF16 parameters: train 3 steps in the saved format, save with
``get_state_dict`` + ``dcp.save``, resume in the live format through the README's loop (``dcp.load`` into the template
and ``set_state_dict``), train 2 steps; compare with the run that converted in memory (``load_state_dict`` of the
saved optimizer's own state dict, model first). Prints a Markdown table: per pair, the largest parameter
difference from that run, or DCP's refusal.

    python -m benchmarks.probes.dcp_format_changes --out DIR
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import ExactLoadPlanner

FORMATS = {
    "FP32 master": {"master_weights": True},
    "FP16 master": {"master_weights": True, "master_weight_dtype": torch.float16},
    "int16 remainders": {"master_weights": True, "store_param_remainders": True},
    "no master": {},
}
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def build(options: dict, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    return model, PortableFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, **options)


def train(model, opt, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step)
        model(torch.randn(16, 64, generator=gen).bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def resume(saved: str, live: str, planner, folder: Path) -> str:
    model, opt = build(FORMATS[saved], 0)
    train(model, opt, 0, 3)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))
    want_model, want = build(FORMATS[live], 1)
    want_model.load_state_dict(model.state_dict())
    want.load_state_dict(opt.state_dict())
    got_model, got = build(FORMATS[live], 2)
    msd, osd = get_state_dict(got_model, got, options=FLAT)
    state = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=str(folder), planner=planner)
    except BaseException as exc:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
        line = next((s for s in lines if s.startswith("RuntimeError: ")), lines[-1])
        return f"refused: {line.removeprefix('RuntimeError: ')}"
    set_state_dict(got_model, got, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
    train(got_model, got, 3, 2)
    train(want_model, want, 3, 2)
    pairs = zip(got_model.parameters(), want_model.parameters())
    diff = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    return "bitwise" if diff == 0 else f"parameters {diff:.3g} off"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for dcp_format_changes.md")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows = ["| saved -> live | DCP's default planner | `ExactLoadPlanner` |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as scratch:
        for i, (saved, live) in enumerate((a, b) for a in FORMATS for b in FORMATS if a != b):
            default = resume(saved, live, None, Path(scratch, f"{i}-default"))
            exact = resume(saved, live, ExactLoadPlanner(), Path(scratch, f"{i}-exact"))
            rows.append(f"| {saved} -> {live} | {default} | {exact} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dcp_format_changes.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
