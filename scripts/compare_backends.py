"""PortableFusedAdam against TE's own FusedAdam, side by side, on identical parameters and gradients.

    PYTHONPATH=. python -m scripts.compare_backends --out runs/compare       # CUDA + TE: every configuration
    PYTHONPATH=. python -m scripts.compare_backends --steps 50 --configs bf16-moments,fp32
    PYTHONPATH=. python -m scripts.compare_backends --against portable --device cpu   # self-check, no GPU

For every configuration x gradient kind (normal: N(0, 1) gradients; eps: N(0, 1e-10) gradients, so that
sqrt(v_hat) << eps) x learning rate, both optimizers run ``--steps`` steps on clones of the same parameters
with the same gradients. Reported per tensor kind (parameters, and every state as unscaled FP32 through
``get_unscaled_state``; int16 remainders joined with their BF16 parameter into the FP32 master): the largest
``max|a - b| / max|b|`` over the tensors, and whether every tensor is bitwise equal. Written to ``--out``:
``compare.md`` (markdown table) and ``compare.jsonl`` (one line per run). Exit status 1 when a run exceeds
``--max-rel`` (default 1e-6) or is not bitwise where bitwise is required (``--bitwise``), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import torch

from optim_factory import PortableFusedAdam
from optim_factory.optimizers import kernel_math
from optim_factory.optimizers.export import join_bf16_remainder
from scripts import cli_args

FP8 = torch.uint8  # TE's spelling of FP8 E4M3 moments
BF16_MOMENTS = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
MASTER = dict(master_weights=True)
REMAINDERS = dict(master_weights=True, store_param_remainders=True)


@dataclass(frozen=True)
class Config:
    name: str
    param_dtype: torch.dtype
    kwargs: dict = field(default_factory=dict)


CONFIGS: list[Config] = [
    Config("fp32", torch.float32),
    Config("l2-mode", torch.float32, dict(adam_w_mode=False)),
    Config("bf16-params-fp32-master", torch.bfloat16, MASTER),
    Config("bf16-params-fp32-master-remainders", torch.bfloat16, REMAINDERS),
    Config("bf16-params-fp16-master", torch.bfloat16, dict(master_weights=True, master_weight_dtype=torch.float16)),
    Config("fp16-params-fp32-master", torch.float16, MASTER),
    Config("fp16-params-no-master", torch.float16),
    Config("l2-mode-bf16-params-fp32-master", torch.bfloat16, dict(adam_w_mode=False, **MASTER)),
    Config("fp16-moments", torch.float32, dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)),
    Config("fp8-moments", torch.float32, dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8)),
    Config("bf16-moments", torch.float32, BF16_MOMENTS),
    Config("bf16-moments-bf16-params-fp32-master", torch.bfloat16, dict(**BF16_MOMENTS, **MASTER)),
    Config("bf16-moments-bf16-params-remainders", torch.bfloat16, dict(**BF16_MOMENTS, **REMAINDERS)),
    Config("bf16-exp-avg-only", torch.float32, dict(exp_avg_dtype=torch.bfloat16)),
    Config("capturable-fp32", torch.float32, dict(capturable=True)),
    Config("capturable-bf16-moments-fp32-master", torch.bfloat16, dict(capturable=True, **BF16_MOMENTS, **MASTER)),
    Config("no-bias-correction", torch.float32, dict(bias_correction=False)),
]
GRAD_SCALES = {"normal": 1.0, "eps": 1e-10}
LRS = (1e-2, 1e-4)
SHAPES = [(1024, 1024), (1000,), (512, 300), (33,)]
HP = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(dtype: torch.dtype, shapes, device, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in shapes]


def grads(step: int, params, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(device=p.device, dtype=p.dtype) for p in params]


def states_fp32(opt, params) -> dict[str, list[torch.Tensor]]:
    """Every state as FP32 (through ``get_unscaled_state``), int16 remainders joined into the FP32 master."""
    out: dict[str, list[torch.Tensor]] = {}
    for p in params:
        for name in opt.state[p]:
            value = opt.get_unscaled_state(p, name)
            if value.dtype == torch.int16:
                value = join_bf16_remainder(p.detach(), value)
            out.setdefault(name, []).append(value.detach().float().cpu())
    return out


def deviation(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, bool]:
    """(largest max|a-b| / max|b| over the tensors, every tensor bitwise equal)."""
    rel, bitwise = 0.0, True
    for x, y in zip(a, b, strict=True):
        x, y = x.detach().float().cpu(), y.detach().float().cpu()
        bitwise = bitwise and torch.equal(x, y) and x.dtype == y.dtype
        if y.numel():
            rel = max(rel, (x - y).abs().max().item() / max(y.abs().max().item(), 1e-30))
    return rel, bitwise


def run(config: Config, grad_kind: str, lr: float, *, cls_a, cls_b, steps: int, shapes, device) -> dict:
    """Run ``cls_a`` (the twin) and ``cls_b`` (the reference) side by side; the deviations per tensor kind."""
    params_a = make_params(config.param_dtype, shapes, device)
    params_b = make_params(config.param_dtype, shapes, device)
    opt_a = cls_a(params_a, lr=lr, **HP, **config.kwargs)
    opt_b = cls_b(params_b, lr=lr, **HP, **config.kwargs)
    for step in range(steps):
        for pa, pb, g in zip(params_a, params_b, grads(step, params_a, GRAD_SCALES[grad_kind])):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    found = {"params": deviation(list(params_a), list(params_b))}
    sa, sb = states_fp32(opt_a, params_a), states_fp32(opt_b, params_b)
    if sa.keys() != sb.keys():
        raise RuntimeError(f"{config.name}: states {sorted(sa)} vs {sorted(sb)}")
    for name in sa:
        found[name] = deviation(sa[name], sb[name])
    return {
        "config": config.name,
        "grads": grad_kind,
        "lr": lr,
        "steps": steps,
        "max_rel": {k: r for k, (r, _) in found.items()},
        "bitwise": {k: b for k, (_, b) in found.items()},
    }


def verdict(result: dict, max_rel: float, bitwise: bool) -> bool:
    """True when the run is within ``max_rel`` everywhere (and bitwise everywhere when required)."""
    if bitwise and not all(result["bitwise"].values()):
        return False
    return all(r <= max_rel for r in result["max_rel"].values())


KINDS = ("params", "exp_avg", "exp_avg_sq", "master_param")


def markdown(results: list[dict], max_rel: float, bitwise: bool) -> str:
    lines = [
        "| configuration | grads | lr | " + " | ".join(KINDS) + " | ok |",
        "|---|---|---|" + "---|" * (len(KINDS) + 1),
    ]
    for r in results:
        cells = []
        for k in KINDS:
            if k not in r["max_rel"]:
                cells.append("—")
            else:
                cells.append("bitwise" if r["bitwise"][k] else f"{r['max_rel'][k]:.1e}")
        ok = "yes" if verdict(r, max_rel, bitwise) else "**NO**"
        lines.append(f"| {r['config']} | {r['grads']} | {r['lr']:g} | " + " | ".join(cells) + f" | {ok} |")
    return "\n".join(lines) + "\n"


def reference_class(against: str):
    if against == "portable":
        return PortableFusedAdam
    from transformer_engine.pytorch.optimizers import FusedAdam

    return FusedAdam


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=cli_args.out_dir, default=None, help="directory for compare.md and compare.jsonl")
    ap.add_argument("--steps", type=cli_args.positive_int, default=25, help="optimizer steps per run (default 25)")
    ap.add_argument(
        "--configs", default="all", help="comma-separated names, or 'all': " + ", ".join(c.name for c in CONFIGS)
    )
    ap.add_argument("--against", choices=("te", "portable"), default="te", help="reference optimizer (default te)")
    ap.add_argument("--device", type=cli_args.device, default="cuda", help="default cuda")
    ap.add_argument(
        "--max-rel", type=cli_args.positive_float, default=1e-6, help="largest allowed max|a-b|/max|b| (default 1e-6)"
    )
    ap.add_argument("--bitwise", action="store_true", help="require every tensor to be bitwise equal")
    ap.add_argument("--small", action="store_true", help="small tensors (a quick smoke run)")
    args = ap.parse_args(argv)
    names = {c.name for c in CONFIGS}
    if args.configs != "all":
        unknown = sorted(set(args.configs.split(",")) - names)
        if unknown:
            ap.error(f"--configs: unknown {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
    if args.against == "te":
        cli_args.require_te(ap, "--against te")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen = [c for c in CONFIGS if args.configs == "all" or c.name in args.configs.split(",")]
    cls_b = reference_class(args.against)
    shapes = [(8, 5), (33,)] if args.small else SHAPES
    results = []
    for config in chosen:
        for grad_kind in GRAD_SCALES:
            for lr in LRS:
                r = run(
                    config,
                    grad_kind,
                    lr,
                    cls_a=PortableFusedAdam,
                    cls_b=cls_b,
                    steps=args.steps,
                    shapes=shapes,
                    device=args.device,
                )
                r["ok"] = verdict(r, args.max_rel, args.bitwise)
                results.append(r)
                print(json.dumps(r), flush=True)
    table = markdown(results, args.max_rel, args.bitwise)
    approx = kernel_math.hardware_approximations(args.device)
    table = (
        f"PortableFusedAdam's reciprocal and square root on {args.device}: "
        + ("the GPU's approximations (Triton)" if approx else "correctly rounded")
        + f"; {args.steps} steps; reference: {args.against}\n\n"
        + table
    )
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compare.md").write_text(table)
        (args.out / "compare.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    failed = [f"{r['config']}/{r['grads']}/lr={r['lr']:g}" for r in results if not r["ok"]]
    if failed:
        print(
            f"exceeds max-rel {args.max_rel:g}{' or not bitwise' if args.bitwise else ''}: {', '.join(failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
