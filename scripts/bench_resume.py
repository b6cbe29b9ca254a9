"""A resume's GPU peak against the states it must create, per optimizer path, in one run.

    torchrun --standalone --nproc_per_node=1 -m scripts.bench_resume --out DIR --scratch DIR    # one GPU
    python -m scripts.bench_resume --out DIR --scratch DIR --device cpu --width 64 --layers 2  # CPU: the flow only

An FSDP2 model (``--layers`` Linear+GELU blocks of ``--width``, BF16 parameters; the default is 537M parameters),
FP32 master, BF16 moments. One checkpoint is written first (our class, 2 steps, flattened ``get_state_dict``,
``dcp.save``). Then each case builds a fresh model and optimizer and resumes the standard way: ``get_state_dict``
as the template, ``dcp.load``, ``set_state_dict``. Per case, above the memory of the fresh model and optimizer:

* ``live states``: what is allocated after the resume (the states that must exist);
* ``peak``: the GPU peak during the resume (``torch.cuda.max_memory_allocated``);
* ``goal``: peak <= live states + 2 chunks of the export (``state_dict_offload_chunk_bytes``).

Cases: ``te`` (Transformer Engine's own FusedAdam), ``te-dcp-cpu-offload`` (the same with
``StateDictOptions(cpu_offload=True)``), ``ours`` (``optim_factory.FusedAdam`` with ``state_dict_cpu_offload`` and
``initialize_states()`` before the template) and ``ours-dcp-init`` (``ours`` without ``initialize_states()``: DCP
creates the states by a step on zero gradients, allocated for it). Without TE and CUDA, ``ours`` is
``PortableFusedAdam``, the TE rows are left out and no peak is measured; every case still checks that the resumed
states equal the saved ones bitwise.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from optim_factory.optimizers.export import local_tensor
from recipes.distributed import init_distributed, pick_device, resolve_dist_env, shutdown
from scripts import cli_args
from scripts.bench_export import environment, sync, write_results
from scripts.bench_save import Trainer, blocks

CASES = ("te", "te-dcp-cpu-offload", "ours", "ours-dcp-init")
ADAM = dict(lr=1e-5, master_weights=True)


def make_optimizer(case: str, model, device: torch.device):
    from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE

    if case.startswith("te"):
        from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam

        return TEFusedAdam(model.parameters(), exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **ADAM)
    if TE_AVAILABLE and device.type == "cuda":
        from optim_factory import FusedAdam as cls
    else:
        from optim_factory import PortableFusedAdam as cls
    with warnings.catch_warnings():  # on CPU: "no memory effect here"
        warnings.simplefilter("ignore", UserWarning)
        return cls(
            model.parameters(), exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", state_dict_cpu_offload=True, **ADAM
        )


def allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    sync(device)
    return torch.cuda.memory_allocated(device)


def states_of(opt) -> dict[str, torch.Tensor]:
    """Every state as FP32 on the host (what the checkpoint holds), keyed by parameter index and name."""
    out = {}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for name, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                out[f"{i}.{name}"] = local_tensor(opt.get_unscaled_state(p, name)).float().cpu()
    return out


def resume(case: str, ctx: dict) -> dict:
    device, width, layers, mesh = ctx["device"], ctx["width"], ctx["layers"], ctx["mesh"]
    model = blocks(width, layers, device, mesh, seed=1)  # other parameters than the checkpoint's: all are loaded
    opt = make_optimizer(case, model, device)
    options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=case == "te-dcp-cpu-offload")
    base = allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if case == "ours":
        opt.initialize_states()
    msd, osd = get_state_dict(model, opt, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(ctx["checkpoint"]), process_group=ctx["group"])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    del msd, osd, state
    gc.collect()
    after = allocated(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    states = states_of(opt)
    equal = states.keys() == ctx["saved"].keys() and all(torch.equal(states[k], ctx["saved"][k]) for k in states)
    steps = sorted({g["step"] if isinstance(g["step"], int) else int(g["step"]) for g in opt.param_groups})
    chunk = getattr(opt, "state_dict_offload_chunk_bytes", None) or ctx["chunk"]
    row = dict(
        case=case,
        optimizer=type(opt).__module__ + "." + type(opt).__name__,
        states_equal_saved=equal,
        step=steps,
        live_mib=None if base is None else (after - base) / 2**20,
        peak_mib=None if base is None else (peak - base) / 2**20,
        chunk_mib=chunk / 2**20,
    )
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def render(rows: list[dict], meta: dict) -> str:
    def mib(v):
        return "n/a" if v is None else f"{v:.0f}"

    lines = [
        "# A resume's GPU peak (scripts/bench_resume.py)",
        "",
        f"Command: `{meta['command']}`",
        "",
        *meta["environment"],
        f"- model: {meta['layers']} x Linear({meta['width']}, {meta['width']}) + GELU, FSDP2 over {meta['world']} "
        f"rank(s), {meta['params']:,} BF16 parameters, FP32 master, BF16 moments; the checkpoint after "
        "2 steps; MiB above the fresh model and optimizer",
        "",
        "| case | optimizer | live states (MiB) | peak (MiB) | peak - live (MiB) | goal: <= live + 2 chunks | "
        "states = saved, bitwise | step |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        over = None if r["peak_mib"] is None else r["peak_mib"] - r["live_mib"]
        goal = "n/a" if over is None else ("yes" if over <= 2 * r["chunk_mib"] else "no")
        goal += f" (2 x {r['chunk_mib']:.0f} MiB)"
        lines.append(
            f"| {r['case']} | `{r['optimizer']}` | {mib(r['live_mib'])} | {mib(r['peak_mib'])} | {mib(over)} | "
            f"{goal} | {'yes' if r['states_equal_saved'] else '**no**'} | {r['step']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli_args.HelpFormatter)
    ap.add_argument("--out", type=cli_args.out_dir, required=True, help="bench_resume.md and .jsonl go here")
    ap.add_argument("--scratch", type=cli_args.out_dir, default=Path(tempfile.gettempdir()), help="for the checkpoint")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA where there is one")
    ap.add_argument("--width", type=cli_args.positive_int, default=4096, help="each Linear block's width")
    ap.add_argument("--layers", type=cli_args.positive_int, default=32, help="Linear blocks (32 x 4096: 537M params)")
    ap.add_argument("--cases", default=",".join(CASES), help="cases to run, comma-separated")
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    if not cases or any(c not in CASES for c in cases):
        ap.error(f"--cases={args.cases!r}: cases from {','.join(CASES)}")
    env = resolve_dist_env(os.environ)
    device = pick_device(args.device, env.local_rank)
    from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE

    if not (TE_AVAILABLE and device.type == "cuda"):
        cases = [c for c in cases if not c.startswith("te")]  # TE's class needs TE and CUDA
    mesh = init_distributed(env, device)
    scratch = Path(args.scratch) / "bench_resume"
    checkpoint = scratch / "checkpoint"
    group = dist.new_group(backend="gloo")
    model = blocks(args.width, args.layers, device, mesh)
    opt = make_optimizer("ours", model, device)
    trainer = Trainer(model, opt, 64, args.width, device)
    for _ in range(2):
        trainer.step()
    saved = states_of(opt)
    params = sum(p.numel() for p in model.parameters())
    if dist.get_rank() == 0:
        shutil.rmtree(checkpoint, ignore_errors=True)
    dist.barrier()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(checkpoint), process_group=group)
    chunk = opt.state_dict_offload_chunk_bytes
    del model, opt, trainer, msd, osd
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ctx = dict(
        device=device, width=args.width, layers=args.layers, mesh=mesh, checkpoint=checkpoint, group=group
    ) | dict(saved=saved, chunk=chunk)
    rows = [resume(case, ctx) for case in cases]
    if dist.get_rank() == 0:
        meta = dict(
            command=("torchrun --standalone --nproc_per_node=1" if "RANK" in os.environ else "python")
            + " -m scripts.bench_resume "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            environment=environment(device, "te" if TE_AVAILABLE and device.type == "cuda" else "portable"),
            width=args.width,
            layers=args.layers,
            world=dist.get_world_size(),
            params=params,
        )
        write_results(args.out, "bench_resume", meta, rows, render(rows, meta))
        shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
