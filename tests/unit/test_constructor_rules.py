"""The constructor rules (optim_factory/rules/) as both FusedAdam classes apply them.

Issue 15, observation 10: ``PortableFusedAdam`` refuses lr=NaN, lr<0, betas=(1.0, ...), betas=(0.9, 1.5), eps<0,
weight_decay<0 and ``master_weights="yes"``. Issue 16, item 3: both classes take dtype and size strings.
The TE subclass checks before it needs Transformer Engine, so its refusals are tested on CPU machines too.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.errors import ConfigError
from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE
from optim_factory.optimizers.te_fused_adam import FusedAdam as TEFusedAdam
from optim_factory.rules.adam import parse_dtype
from optim_factory.rules.export import parse_bytes

CLASSES = [PortableFusedAdam, TEFusedAdam]


def params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


# kwargs, the message (torch.optim.Adam's where it has one: compared below)
BAD_HYPERPARAMETERS = [
    (dict(lr=float("nan")), "Invalid learning rate: nan"),
    (dict(lr=-1e-3), "Invalid learning rate: -0.001"),
    (dict(lr=float("inf")), "Invalid learning rate: inf"),
    (dict(lr="1e-3"), "Invalid learning rate: '1e-3'"),
    (dict(lr=True), "Invalid learning rate: True"),
    (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9, 1.5)), "Invalid beta parameter at index 1: 1.5"),
    (dict(betas=(-0.1, 0.999)), "Invalid beta parameter at index 0: -0.1"),
    (dict(betas=(0.9, float("nan"))), "Invalid beta parameter at index 1: nan"),
    (dict(betas=(0.9,)), "betas=[0.9]: expected two numbers"),
    (dict(betas=(0.9, 0.99, 0.999)), "betas=[0.9, 0.99, 0.999]: expected two numbers"),
    (dict(betas="0.9,0.999"), "betas='0.9,0.999': expected two numbers"),
    (dict(eps=-1e-8), "Invalid epsilon value: -1e-08"),
    (dict(eps=float("nan")), "Invalid epsilon value: nan"),
    (dict(eps=float("inf")), "Invalid epsilon value: inf"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    (dict(weight_decay=float("inf")), "Invalid weight_decay value: inf"),
    (dict(master_weights="yes"), "master_weights='yes': expected True or False"),
    (dict(capturable=1), "capturable=1: expected True or False"),
    (dict(adam_w_mode="false"), "adam_w_mode='false': expected True or False"),
    (dict(bias_correction=None), "bias_correction=None: expected True or False"),
    (dict(store_param_remainders="true"), "store_param_remainders='true': expected True or False"),
    (dict(exp_avg_dtype="fp64"), "exp_avg_dtype='fp64': FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg."),
    (dict(exp_avg_sq_dtype="torch.int8"), "exp_avg_sq_dtype='torch.int8': FusedAdam only supports"),
    (dict(master_weight_dtype="bf16"), "master_weight_dtype='bf16': FusedAdam only supports fp32/fp16 master"),
    (dict(capturable=True, exp_avg_dtype="fp16"), "exp_avg_dtype='fp16/torch.float32': Capturable mode requires"),
    (dict(state_dict_offload_chunk_bytes="64 MB"), "state_dict_offload_chunk_bytes='64 MB': expected null"),
]


def torch_adam_message(kw: dict) -> str | None:
    """What torch.optim.Adam says about the same value (None: it accepts it or has no such option)."""
    torch_kw = {k: v for k, v in kw.items() if k in ("lr", "betas", "eps", "weight_decay")}
    if not torch_kw:
        return None
    try:
        torch.optim.Adam(params(), **torch_kw)
    except (ValueError, TypeError, IndexError) as exc:
        return str(exc) if isinstance(exc, ValueError) and str(exc).startswith("Invalid") else None
    return None


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("kw,message", BAD_HYPERPARAMETERS, ids=[str(b[0]) for b in BAD_HYPERPARAMETERS])
def test_bad_option_is_refused_in_one_line_before_anything_else(cls, kw, message):
    with pytest.raises(ValueError) as info:  # TE subclass: before the Transformer Engine check (no ImportError)
        cls(params(), **kw)
    text = str(info.value)
    assert isinstance(info.value, ConfigError) and "\n" not in text
    assert message in text, text
    theirs = torch_adam_message(kw)
    if theirs is not None:  # torch.optim.Adam's own words, then what is allowed
        assert text.startswith(theirs), (text, theirs)


def test_torch_lets_these_through_and_we_do_not():
    """Why the finiteness rule exists: torch.optim.Adam takes an infinite lr, eps and weight decay."""
    for kw in (dict(lr=math.inf), dict(eps=math.inf), dict(weight_decay=math.inf)):
        torch.optim.Adam(params(), **kw)
        with pytest.raises(ValueError):
            PortableFusedAdam(params(), **kw)


def test_nan_lr_no_longer_trains_to_nan():
    """lr=NaN is refused: accepted, one step would make every parameter NaN."""
    ps = params()
    with pytest.raises(ValueError, match="Invalid learning rate: nan"):
        PortableFusedAdam(ps, lr=float("nan"))
    assert all(torch.isfinite(p).all() for p in ps)


def test_edge_values_torch_accepts_are_accepted():
    ps = params()
    opt = PortableFusedAdam(ps, lr=0.0, betas=[0.0, 0.0], eps=0.0, weight_decay=0)
    g = opt.param_groups[0]
    assert g["lr"] == 0.0 and g["betas"] == (0.0, 0.0) and g["eps"] == 0.0 and g["weight_decay"] == 0.0
    one_element = PortableFusedAdam(params(), lr=torch.tensor(0.01), capturable=True)
    assert float(one_element.param_groups[0]["lr"]) == pytest.approx(0.01)


SPELLINGS = [
    ("fp32", torch.float32),
    ("float32", torch.float32),
    ("torch.float32", torch.float32),
    ("fp16", torch.float16),
    ("half", torch.float16),
    ("bf16", torch.bfloat16),
    ("bfloat16", torch.bfloat16),
    ("torch.bfloat16", torch.bfloat16),
    ("BF16", torch.bfloat16),
    ("fp8", torch.uint8),
    ("float8_e4m3fn", torch.uint8),
    ("torch.float8_e4m3fn", torch.uint8),
    ("uint8", torch.uint8),
    (torch.bfloat16, torch.bfloat16),
    (torch.float8_e4m3fn, torch.uint8),
    (torch.uint8, torch.uint8),
]


@pytest.mark.parametrize("spelling,dtype", SPELLINGS, ids=[str(s[0]) for s in SPELLINGS])
def test_portable_takes_every_dtype_spelling(spelling, dtype):
    opt = PortableFusedAdam(params(), exp_avg_dtype=spelling, exp_avg_sq_dtype=spelling)
    assert opt.exp_avg_dtype == opt.exp_avg_sq_dtype == dtype
    assert parse_dtype(spelling) == dtype


def test_strings_and_list_betas_build_the_same_optimizer_as_torch_values():
    """A YAML-shaped call (strings, a list) and the torch-typed call give the same optimizer and the same step."""
    a_params, b_params = params(), params()
    a = PortableFusedAdam(
        a_params,
        lr=1e-2,
        betas=[0.8, 0.95],
        master_weight_dtype="fp32",
        exp_avg_dtype="bf16",
        exp_avg_sq_dtype="torch.float16",
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes="1MiB",
    )
    b = PortableFusedAdam(
        b_params,
        lr=1e-2,
        betas=(0.8, 0.95),
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.float16,
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes=1 << 20,
    )
    assert a.param_groups[0]["betas"] == b.param_groups[0]["betas"] == (0.8, 0.95)
    assert a.state_dict_offload_chunk_bytes == b.state_dict_offload_chunk_bytes == 1 << 20
    for ps in (a_params, b_params):
        for p in ps:
            p.grad = torch.ones_like(p)
    a.step()
    b.step()
    assert all(torch.equal(x, y) for x, y in zip(a_params, b_params))


@pytest.mark.parametrize(
    "value,expected", [(None, None), (4096, 4096), ("64MiB", 64 << 20), ("1GiB", 1 << 30), (" 8 KiB ", 8 << 10)]
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value, "k") == expected


@pytest.mark.parametrize("value", ["64 MB", "1.5GiB", True, 1.0, "-1"])
def test_parse_bytes_refuses(value):
    with pytest.raises(ConfigError, match=r"^k="):
        parse_bytes(value, "k")


def test_option_error_is_what_torch_and_te_raise():
    """ValueError as torch.optim.Adam raises, RuntimeError as TE's FusedAdam raises: old except clauses hold."""
    with pytest.raises(ValueError):
        PortableFusedAdam(params(), lr=-1.0)
    with pytest.raises(RuntimeError):
        PortableFusedAdam(params(), exp_avg_dtype=torch.float64)


def test_remainders_without_fp32_master_warn():
    with pytest.warns(UserWarning, match="store_param_remainders=True has no effect"):
        opt = PortableFusedAdam(params(), store_param_remainders=True)
    assert opt.store_param_remainders is False


def test_te_subclass_and_twin_share_one_signature():
    """Same parameter names, kinds and defaults: a YAML block built for one builds the other."""
    te = inspect.signature(TEFusedAdam.__init__).parameters
    portable = inspect.signature(PortableFusedAdam.__init__).parameters
    assert [(p.name, p.kind, p.default) for p in te.values()] == [
        (p.name, p.kind, p.default) for p in portable.values()
    ]


@pytest.mark.skipif(TE_AVAILABLE, reason="checks the CPU path: Transformer Engine is importable here")
def test_te_subclass_checks_then_says_te_is_missing():
    with pytest.raises(ImportError, match="Transformer Engine"):
        TEFusedAdam(params(), exp_avg_dtype="bf16", state_dict_cpu_offload=True, state_dict_offload_chunk_bytes="64MiB")


@pytest.mark.skipif(not TE_AVAILABLE, reason="Transformer Engine is not importable")
def test_te_defaults_equal_ours():
    from transformer_engine.pytorch.optimizers import FusedAdam as Upstream

    theirs = inspect.signature(Upstream.__init__).parameters
    ours = inspect.signature(TEFusedAdam.__init__).parameters
    for name, p in theirs.items():
        if p.default is not inspect.Parameter.empty:
            assert ours[name].default == p.default, name


def test_every_param_group_is_checked_and_a_refused_one_is_not_added():
    """A group's lr=-0.1 or betas=(0.9, 1.0) (or add_param_group's lr=nan) is refused: accepted, it would train to
    NaN without a word, and the optimizer's own checkpoint would be refused at load. Broken on purpose (no group
    check): accepted."""
    w, b, c = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))
    with pytest.raises(ValueError, match=r"^param group 1: Invalid learning rate: -0.1"):
        PortableFusedAdam([{"params": [w]}, {"params": [b], "lr": -0.1}], lr=1e-2)
    with pytest.raises(ValueError, match=r"^param group 1: Invalid beta parameter at index 1: 1.0"):
        PortableFusedAdam([{"params": [w]}, {"params": [b], "betas": (0.9, 1.0)}], lr=1e-2)
    opt = PortableFusedAdam([w], lr=1e-2)
    with pytest.raises(ValueError, match=r"^param group 1: Invalid learning rate: nan"):
        opt.add_param_group({"params": [c], "lr": float("nan")})
    assert len(opt.param_groups) == 1  # not added
    opt.add_param_group({"params": [c], "lr": 1e-3})
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3]


def test_capturable_groups_each_get_their_own_lr_tensor():
    """On the CPU too each group has its own lr tensor: a shared one would collapse LambdaLR's per-group factors."""
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = PortableFusedAdam([{"params": [a]}, {"params": [b]}], lr=1e-2, capturable=True)
    assert opt.param_groups[0]["lr"] is not opt.param_groups[1]["lr"]
    torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.0])
    assert [float(g["lr"]) for g in opt.param_groups] == [pytest.approx(1e-2), 0.0]  # FP32 tensors


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"amsgrad": True}, "amsgrad=True: optimizer-wide in FusedAdam"),  # constructor's amsgrad=True is refused
        ({"adam_w_mode": False}, "adam_w_mode=False: optimizer-wide in FusedAdam"),  # else ignored
        ({"weight_decy": 0.1}, "weight_decy=0.1: not a FusedAdam param group key; did you mean weight_decay?"),
        ({"bias_correction": "no"}, "bias_correction='no': expected True or False"),  # else truthy: correction on
        ({"step": -1}, "step=-1: expected the group's step count"),
    ],
)
def test_a_group_key_that_would_do_nothing_is_refused(extra, words):
    """Each of these, accepted in a param group, would change nothing (or do the opposite)."""
    w, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError) as info:
        PortableFusedAdam([{"params": [w]}, {"params": [b], **extra}], lr=1e-2)
    assert str(info.value).startswith(f"param group 1: {words}"), str(info.value)
    opt = PortableFusedAdam([w], lr=1e-2)
    with pytest.raises(ValueError, match="^param group 1: "):
        opt.add_param_group({"params": [b], **extra})
    assert len(opt.param_groups) == 1


def test_the_callers_own_group_keys_stay():
    w = torch.nn.Parameter(torch.randn(4))
    opt = PortableFusedAdam([{"params": [w], "name": "decoder", "lr_scale": 0.5}], lr=1e-2)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # adds initial_lr
    assert opt.param_groups[0]["name"] == "decoder" and opt.param_groups[0]["initial_lr"] == 1e-2


def test_parameters_step_cannot_update_are_refused_when_added():
    """A float64 parameter (or FP16 and BF16 in one group) is refused when added: accepted, step() would update the
    earlier parameters, count the step and make the states before it raised (TE: the count and the states)."""
    w = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=r"^param group 0: parameter 1 has dtype torch.float64: FusedAdam updates"):
        PortableFusedAdam([w, torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    half, bf16 = (torch.nn.Parameter(torch.randn(3, dtype=d)) for d in (torch.float16, torch.bfloat16))
    with pytest.raises(ValueError, match=r"^param group 0: FusedAdam does not support a mix of float16 and bfloat16"):
        PortableFusedAdam([half, bf16])
    PortableFusedAdam([{"params": [half]}, {"params": [bf16]}])  # one dtype per group: as TE


@pytest.mark.parametrize(
    "options",
    [
        dict(exp_avg_dtype="fp16"),
        dict(exp_avg_sq_dtype="fp16"),
        dict(master_weights=True, master_weight_dtype="fp16", p_dtype=torch.bfloat16),
    ],
)
def test_a_0d_parameter_with_scaled_states_is_refused(options):
    """A 0-d parameter (a logit scale) with FP16 states is refused when added: accepted, step() would raise ("output
    with shape [] doesn't match the broadcast shape [1]", TE's unscaling too) after updating the other
    parameters."""
    options = dict(options)
    dtype = options.pop("p_dtype", torch.float32)
    w, scalar = torch.nn.Parameter(torch.randn(4, dtype=dtype)), torch.nn.Parameter(torch.tensor(2.0, dtype=dtype))
    with pytest.raises(ValueError, match=r"^param group 0: parameter 1 is 0-dimensional: FusedAdam cannot unscale"):
        PortableFusedAdam([w, scalar], **options)
    opt = PortableFusedAdam([w], **options)
    with pytest.raises(ValueError, match=r"^param group 1: parameter 0 is 0-dimensional"):
        opt.add_param_group({"params": [scalar]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_a_0d_parameter_with_fp8_or_bf16_moments_steps_exports_and_loads(dtype):
    """TE's FP8 states take a 0-d parameter (H200, TE 2.20.2), and so do the twin's FP8 and BF16 states.
    Broken on purpose (the [1]-shaped scale multiplied into the 0-d state): the step raises."""
    w, scalar = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.tensor(2.0))
    kw = dict(lr=0.1, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    chunked = dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=1 << 20)
    opt = PortableFusedAdam([w, scalar], **kw, **chunked)
    for _ in range(2):
        w.grad, scalar.grad = torch.ones(4), torch.tensor(1.0)
        opt.step()
    sd = opt.state_dict()
    assert sd["state"][1]["exp_avg"].shape == () and sd["state"][1]["exp_avg"].dtype == torch.float32
    twin = PortableFusedAdam(
        [torch.nn.Parameter(w.detach().clone()), torch.nn.Parameter(scalar.detach().clone())], **kw
    )
    twin.load_state_dict(sd)
    assert torch.equal(twin.state_dict()["state"][1]["exp_avg"], sd["state"][1]["exp_avg"])


def test_a_0d_parameter_with_unscaled_states_steps():
    scalar = torch.nn.Parameter(torch.tensor(2.0))
    with pytest.warns(UserWarning, match="master_weight_dtype=fp16 has no effect"):  # no master: nothing scaled
        opt = PortableFusedAdam([scalar], lr=0.1, exp_avg_dtype="bf16", master_weight_dtype="fp16")
    scalar.grad = torch.tensor(1.0)
    opt.step()
    assert float(scalar.detach()) == pytest.approx(1.9)


def test_capturable_groups_added_later_get_their_own_lr_tensor():
    """add_param_group's groups get their own lr tensor, as the constructor's do, not the defaults'."""
    a, b, c = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))
    opt = PortableFusedAdam([a], lr=1e-2, capturable=True)
    opt.add_param_group({"params": [b]})
    opt.add_param_group({"params": [c]})
    torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 1.0, lambda s: 2.0])
    assert [float(g["lr"]) for g in opt.param_groups] == [pytest.approx(1e-2), pytest.approx(1e-2), pytest.approx(2e-2)]
    assert float(opt.defaults["lr"]) == pytest.approx(1e-2)


def test_a_refused_step_changes_nothing():
    """A parameter made float64 after the optimizer was built: step() refuses before the first update (no
    earlier parameter stepped, no step counted, no states made)."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = PortableFusedAdam([a, b], lr=0.1)
    b.data = b.data.double()
    a.grad, b.grad = torch.ones(3), torch.ones(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="FusedAdam only support model weights in fp32, fp16, bf16 and fp8"):
        opt.step()
    assert torch.equal(a, torch.ones(3)) and not opt.state and "step" not in opt.param_groups[0]


def test_groups_from_torch_and_keys_of_the_caller_s_own_are_accepted():
    """torch's AdamW groups carry amsgrad=False and capturable=False (the optimizer's own
    values: accepted), and longer keys of the caller's (weight_decay_mult, lrs, steps) are no misspellings. Broken on
    purpose (every optimizer-wide key refused; insertions counted as near misses): refused."""
    model = torch.nn.Linear(3, 3)
    PortableFusedAdam(torch.optim.AdamW(model.parameters(), lr=1e-3).param_groups)
    for key in ("weight_decay_mult", "lrs", "steps", "lr0", "name"):
        PortableFusedAdam([{"params": [torch.nn.Parameter(torch.ones(2))], key: 1}])
    with pytest.raises(ValueError, match=r"capturable=True: optimizer-wide in FusedAdam \(False here\)"):
        PortableFusedAdam([{"params": model.parameters(), "capturable": True}])


def test_frozen_parameters_are_not_held_to_the_step_s_dtype_rules():
    """TE's step() checks dtypes only where there is a gradient: a frozen float64 (or BF16 beside FP16) parameter
    stays allowed, as in TE."""
    frozen64 = torch.nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False)
    half = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    frozen_bf16 = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16), requires_grad=False)
    PortableFusedAdam([torch.nn.Parameter(torch.ones(3)), frozen64])
    PortableFusedAdam([half, frozen_bf16])


def test_a_0d_fp32_parameter_with_an_fp16_master_is_refused():
    """With master_weights, TE keeps a master for FP32 parameters too, and its FP16 master of a 0-d parameter fails in
    step()."""
    w, scalar = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"parameter 1 is 0-dimensional: .* \(master_param; "):
        PortableFusedAdam([w, scalar], master_weights=True, master_weight_dtype="fp16")
