"""What TE 2.20.2's FusedAdam and ours do where the two classes differ (docs/drop-in.md lists them), one section
per process (a CUDA error in one leaves the context unusable), on a machine with CUDA and TE:

    python -m benchmarks.probes.te_fused_adam_cases a   # then b, c, d

a: 0-d parameters with FP16/FP8/BF16 moments, a float64 parameter (what a raising step() leaves behind)
b: GradScaler with capturable=True, with and without scaler.unscale_, against torch.optim.Adam
c: TE's own class, capturable, add_param_group then LambdaLR and step()
d: the same with ours
"""

import sys
import warnings

import torch
from transformer_engine.pytorch.optimizers import FusedAdam as TE

from optim_factory import FusedAdam as Ours

warnings.filterwarnings("ignore")

dev = "cuda"


def attempt(name, fn):
    try:
        r = fn()
        print(name, "OK", r)
    except Exception as e:
        print(name, "RAISED", type(e).__name__, str(e).splitlines()[0][:200])


SECTION = sys.argv[1]


# 1: TE stock, 0-d param with FP16 moments
def zero_d(dtype):
    w = torch.nn.Parameter(torch.randn(4, device=dev))
    s = torch.nn.Parameter(torch.tensor(2.0, device=dev))
    o = TE([w, s], lr=0.1, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    w.grad = torch.ones(4, device=dev)
    s.grad = torch.tensor(1.0, device=dev)
    w0 = w.detach().clone()
    o.step()
    return ("w changed", not torch.equal(w0, w))


if SECTION == "a":
    attempt("te 0-d fp16 step", lambda: zero_d(torch.float16))
if SECTION == "a":
    attempt("te 0-d fp8 step", lambda: zero_d(torch.uint8))
if SECTION == "a":
    attempt("te 0-d bf16 step", lambda: zero_d(torch.bfloat16))


# 1b: after a raise, was w updated / step counted?
def zero_d_state():
    w = torch.nn.Parameter(torch.randn(4, device=dev))
    s = torch.nn.Parameter(torch.tensor(2.0, device=dev))
    o = TE([w, s], lr=0.1, exp_avg_dtype=torch.float16)
    w.grad = torch.ones(4, device=dev)
    s.grad = torch.tensor(1.0, device=dev)
    w0 = w.detach().clone()
    try:
        o.step()
    except Exception:
        pass
    return dict(w_changed=not torch.equal(w0, w), step=o.param_groups[0].get("step"), states=len(o.state))


if SECTION == "a":
    attempt("te 0-d fp16 after raise", zero_d_state)


# 2: float64 param in TE stock: state after raise
def f64():
    a = torch.nn.Parameter(torch.ones(3, device=dev))
    b = torch.nn.Parameter(torch.ones(3, device=dev, dtype=torch.float64))
    o = TE([a, b], lr=0.1)
    a.grad = torch.ones(3, device=dev)
    b.grad = torch.ones(3, device=dev, dtype=torch.float64)
    try:
        o.step()
    except Exception as e:
        print("  raised:", str(e)[:100])
    return dict(
        a_changed=not torch.equal(a, torch.ones(3, device=dev)), step=o.param_groups[0].get("step"), states=len(o.state)
    )


if SECTION == "a":
    attempt("te float64 after raise", f64)


# 3: capturable + add_param_group, TE stock and ours
def cap(cls):
    ps = [torch.nn.Parameter(torch.ones(3, device=dev)) for _ in range(3)]
    o = cls([ps[0]], lr=0.1, capturable=True)
    o.add_param_group({"params": [ps[1]]})
    o.add_param_group({"params": [ps[2]]})
    types = [type(g["lr"]).__name__ for g in o.param_groups]
    shared = o.param_groups[1]["lr"] is o.param_groups[2]["lr"]
    torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 1.0, lambda s: 1.0, lambda s: 2.0])
    lrs = [float(g["lr"]) for g in o.param_groups]
    for p in ps:
        p.grad = torch.ones(3, device=dev)
    try:
        o.step()
        stepped = True
    except Exception as e:
        stepped = f"{type(e).__name__}: {str(e)[:120]}"
    return dict(types=types, shared=shared, lrs=lrs, stepped=stepped)


if SECTION == "c":
    attempt("te capturable add_param_group", lambda: cap(TE))
if SECTION == "d":
    attempt("ours capturable add_param_group", lambda: cap(Ours))


# 4: GradScaler + capturable + unscale_ before step: TE vs torch Adam
def scaler(cls, unscale):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2).to(dev)
    ref = torch.nn.Linear(4, 2).to(dev)
    ref.load_state_dict(m.state_dict())
    o = cls(m.parameters(), lr=0.1, capturable=True, adam_w_mode=False, weight_decay=0.5)
    r = torch.optim.Adam(ref.parameters(), lr=0.1, weight_decay=0.5)
    sc = torch.amp.GradScaler("cuda", init_scale=1024.0)
    sr = torch.amp.GradScaler("cuda", init_scale=1024.0)
    for _ in range(3):
        x = torch.randn(8, 4, device=dev)
        for mod, opt, s in ((m, o, sc), (ref, r, sr)):
            opt.zero_grad()
            s.scale(mod(x).square().sum()).backward()
            if unscale:
                s.unscale_(opt)
            s.step(opt)
            s.update()
    return max((a - b).abs().max().item() for a, b in zip(m.parameters(), ref.parameters()))


if SECTION == "b":
    attempt("te scaler no-unscale diff", lambda: scaler(TE, False))
if SECTION == "b":
    attempt("te scaler unscale_ diff", lambda: scaler(TE, True))
if SECTION == "b":
    attempt("ours-te scaler unscale_ diff", lambda: scaler(Ours, True))


def zero_d_ours(dtype):
    w = torch.nn.Parameter(torch.randn(4, device=dev))
    s = torch.nn.Parameter(torch.tensor(2.0, device=dev))
    o = Ours(
        [w, s],
        lr=0.1,
        exp_avg_dtype=dtype,
        exp_avg_sq_dtype=dtype,
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes=1 << 20,
    )
    for _ in range(2):
        w.grad = torch.ones(4, device=dev)
        s.grad = torch.tensor(1.0, device=dev)
        o.step()
    sd = o.state_dict()
    o.load_state_dict(sd)
    return float(sd["state"][1]["exp_avg"])


if SECTION == "a":
    attempt("ours 0-d fp8 step+export+load", lambda: zero_d_ours(torch.uint8))
if SECTION == "a":
    attempt("ours 0-d fp16 constructor", lambda: zero_d_ours(torch.float16))
