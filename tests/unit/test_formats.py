"""The saved <-> live formats (optim_factory/optimizers/export/formats.py) and the checkpoint contract
(optim_factory/checkpoint/) at the library's level, in one process: keys that survive any number of DCP resumes
for every configuration the constructor accepts, the remainder rounding at ties, the conversions that need the
loaded parameter, ``ExactLoadPlanner``, and exports that never alias live state."""

from __future__ import annotations

import copy
import itertools
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import ExactLoadPlanner, SafeFileSystemReader, finish_load, prepare_load
from optim_factory.optimizers.export import join_bf16_remainder, split_bf16_remainder
from optim_factory.optimizers.updates import f32, group_scalars
from tests.helpers import LiveSnapshot, assert_bitwise, clone_params, deep_clone, make_params, run_steps

pytestmark = pytest.mark.filterwarnings("ignore:state_dict_cpu_offload=True has no memory effect")

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
PARAMS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MASTERS = {
    "no master": {},
    "fp32 master": {"master_weights": True},
    "fp16 master": {"master_weights": True, "master_weight_dtype": torch.float16},
    "remainders": {"master_weights": True, "store_param_remainders": True},
}
MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}


class Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        self.params = torch.nn.ParameterList(make_params(dtype, seed))


def build(dtype: torch.dtype, seed: int = 0, **options) -> tuple[Model, PortableFusedAdam] | None:
    model = Model(dtype, seed)
    try:
        return model, PortableFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, **options)
    except ValueError:  # a combination the constructor refuses (its rules' tests cover the wording)
        return None


def save(model, opt, path) -> None:
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def load(model, opt, path, planner=None) -> None:
    """The README's loop, in one process."""
    msd, osd = get_state_dict(model, opt, options=FLAT)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)


def keys(opt) -> dict:
    return {k: sorted(v) for k, v in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("param", PARAMS)
@pytest.mark.parametrize("master", MASTERS)
def test_keys_survive_any_number_of_dcp_resumes(param, master, tmp_path):
    """For every moment dtype, with and without capturable: the keys after a load are those of a fresh optimizer
    after initialize_states(), and a checkpoint written by the resumed run loads again, bitwise."""
    built = 0
    for (moment, moment_dtype), capturable in itertools.product(MOMENTS.items(), (False, True)):
        options = dict(MASTERS[master], exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype)
        if build(PARAMS[param], capturable=capturable, **options) is None:
            continue
        built += 1
        what = f"{param} params, {master}, {moment} moments, capturable={capturable}"
        folder = tmp_path / f"{moment}-{capturable}"
        fresh = build(PARAMS[param], 7, capturable=capturable, **options)[1]
        fresh.initialize_states()
        model, opt = build(PARAMS[param], capturable=capturable, **options)
        run_steps(opt, list(model.parameters()), 0, 2)
        save(model, opt, folder / "a")
        resumed = build(PARAMS[param], 5, capturable=capturable, **options)
        load(*resumed, folder / "a")
        assert keys(resumed[1]) == keys(fresh), f"{what}: keys after a resume"
        run_steps(resumed[1], list(resumed[0].parameters()), 2, 1)
        save(*resumed, folder / "b")  # the resumed run's checkpoint loads again, bitwise
        again = build(PARAMS[param], 9, capturable=capturable, **options)
        load(*again, folder / "b")
        assert keys(again[1]) == keys(fresh), f"{what}: keys after a second resume"
        for a, b in zip(again[0].parameters(), resumed[0].parameters()):
            assert_bitwise(a, b, f"{what}: parameters of the resumed run's checkpoint")
        for (k, a), b in zip(again[1].state_dict()["state"].items(), resumed[1].state_dict()["state"].values()):
            for name in a:
                assert_bitwise(a[name], b[name], f"{what}: {k}.{name} of the resumed run's checkpoint")
    assert built, f"the constructor refused every configuration of {param} params with {master}"


def test_remainders_round_ties_away_as_the_kernels_do():
    """A master exactly between two BF16 values (low 16 bits 0x8000) rounds up in magnitude, as TE's remainder
    kernels round (RNE would pick the even one); the parameter and remainders rejoin every master exactly."""
    high = torch.tensor([0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0000, 0x4000], dtype=torch.int32)
    lows = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0x0001, 0xFFFF], dtype=torch.int32)
    masters = ((high.unsqueeze(1) << 16) | lows.unsqueeze(0)).reshape(-1).view(torch.float32)
    param = torch.empty(masters.shape, dtype=torch.bfloat16)
    remainders = torch.empty(masters.shape, dtype=torch.int16)
    split_bf16_remainder(masters, param, remainders)
    assert torch.equal(join_bf16_remainder(param, remainders).view(torch.int32), masters.view(torch.int32))
    param_bits = param.view(torch.int16).to(torch.int32) & 0xFFFF
    expected = (high.unsqueeze(1) + (lows.unsqueeze(0) >= 0x8000)).reshape(-1) & 0xFFFF  # ties and above: up
    assert torch.equal(param_bits, expected)
    ties = masters.view(-1, len(lows))[:, 0]  # low bits 0x8000: RNE keeps the even high half, the kernels do not
    assert not torch.equal(param.view(-1, len(lows))[:, 0], ties.to(torch.bfloat16))


def tie_masters(n: int) -> torch.Tensor:
    """FP32 masters exactly between two BF16 values, of both signs."""
    high = (
        torch.arange(0x3C00, 0x3C00 + n, dtype=torch.int32)
        | torch.tensor([0, 0x8000], dtype=torch.int32).repeat(n // 2 + 1)[:n]
    )
    return ((high << 16) | 0x8000).view(torch.float32)


@pytest.mark.parametrize("load_model_after", [False, True], ids=["model first", "model after (set_state_dict)"])
def test_an_fp32_master_loaded_as_remainders_sets_the_parameter(load_model_after):
    """The saved parameter is the master rounded to nearest even; with remainders the parameter must be rounded
    as the kernels round, or parameter and remainders would not rejoin the saved master."""
    masters = tie_masters(16)
    saved_param = masters.to(torch.bfloat16)  # what the FP32-master run holds (RNE)
    src_param = torch.nn.Parameter(saved_param.clone())
    src = PortableFusedAdam([src_param], lr=1e-2, master_weights=True)
    run_steps(src, [src_param], 0, 1)
    sd = deep_clone(src.state_dict())
    sd["state"][0]["master_param"] = masters.clone()
    param = torch.nn.Parameter(torch.zeros_like(saved_param) if load_model_after else saved_param.clone())
    dst = PortableFusedAdam([param], lr=1e-2, master_weights=True, store_param_remainders=True)
    dst.load_state_dict(sd)
    if load_model_after:
        with torch.no_grad():
            param.copy_(saved_param)
    finish_load(dst)
    kernel_rounded = torch.empty_like(saved_param)
    split_bf16_remainder(masters, kernel_rounded, torch.empty(masters.shape, dtype=torch.int16))
    assert not torch.equal(kernel_rounded, saved_param)  # the case at stake: ties
    assert_bitwise(param, kernel_rounded, "parameter")
    rejoined = join_bf16_remainder(param.detach(), dst.state[param]["master_param"])
    assert_bitwise(rejoined, masters, "parameter and remainders rejoin the saved master")


@pytest.mark.parametrize("saved,live", [("remainders", "fp32 master"), ("fp32 master", "remainders"),
                                        ("no master", "fp32 master"), ("no master", "remainders")])  # fmt: skip
def test_a_master_that_needs_the_parameter_follows_a_model_loaded_after_the_optimizer(saved, live):
    """set_state_dict and torchtitan load the optimizer first: the master comes from the parameter as loaded when
    the optimizer next steps or exports, not from the parameter the load saw."""
    params = make_params(torch.bfloat16)
    src = PortableFusedAdam(params, lr=1e-2, **MASTERS[saved])
    run_steps(src, params, 0, 2)
    sd = deep_clone(src.state_dict())
    dst_params = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    dst = PortableFusedAdam(dst_params, lr=1e-2, **MASTERS[live])
    dst.load_state_dict(sd)
    with torch.no_grad():  # the model, loaded after the optimizer
        for p, q in zip(dst_params, params):
            p.copy_(q)
    exported = dst.state_dict()  # settles first
    for i, (p, q) in enumerate(zip(dst_params, params)):
        got = exported["state"][i]["master_param"]
        got = join_bf16_remainder(p.detach(), got) if got.dtype == torch.int16 else got
        if saved == "remainders":
            want = join_bf16_remainder(q.detach(), src.state[q]["master_param"])
        elif saved == "fp32 master":  # split from the loaded parameter: rejoins the saved master
            want = src.state[q]["master_param"]
        else:
            want = q.detach().float()
        assert_bitwise(got, want, f"param {i}: master")


def test_an_fp32_parameter_keeps_its_master_across_loads():
    """TE keeps (and never uses) the master of an FP32 parameter: loaded and exported again, as TE's class does."""
    params = make_params(torch.float32)
    src = PortableFusedAdam(params, lr=1e-2, master_weights=True)
    run_steps(src, params, 0, 2)
    sd = deep_clone(src.state_dict())
    dst = PortableFusedAdam(clone_params(params), lr=1e-2, master_weights=True)
    dst.load_state_dict(sd)
    for i, p in enumerate(dst.param_groups[0]["params"]):
        assert_bitwise(dst.state[p]["master_param"], sd["state"][i]["master_param"], f"param {i}")


@pytest.mark.parametrize("saved,live", [("remainders", "fp32 master"), ("fp32 master", "remainders"),
                                        ("no master", "fp32 master"), ("no master", "remainders")])  # fmt: skip
def test_exact_load_planner_converts_what_dcp_s_default_casts_or_refuses(saved, live, tmp_path):
    """Through DCP (one process, the README's loop): with ExactLoadPlanner the resumed run is the in-memory
    conversion's, bitwise; through DCP's own planner, which casts int16 <-> FP32, the load refuses the cast masters
    and DCP a missing master."""
    model, opt = build(torch.bfloat16, **MASTERS[saved])
    run_steps(opt, list(model.parameters()), 0, 3)
    save(model, opt, tmp_path / "ckpt")
    want_model, want = build(torch.bfloat16, 3, **MASTERS[live])
    with torch.no_grad():
        for p, q in zip(want_model.parameters(), model.parameters()):
            p.copy_(q)
    want.load_state_dict(deep_clone(opt.state_dict()))

    got_model, got = build(torch.bfloat16, 4, **MASTERS[live])
    prepare_load(got)
    load(got_model, got, tmp_path / "ckpt", ExactLoadPlanner())
    for m, o in ((got_model, got), (want_model, want)):
        run_steps(o, list(m.parameters()), 3, 2)
    for a, b in zip(got_model.parameters(), want_model.parameters()):
        assert_bitwise(a, b, "parameter after 2 steps")
    for (k, a), b in zip(got.state_dict()["state"].items(), want.state_dict()["state"].values()):
        for name in a:
            assert_bitwise(a[name], b[name], f"{k}.{name}")

    plain_model, plain = build(torch.bfloat16, 4, **MASTERS[live])
    if saved == "no master":
        with pytest.raises(BaseException, match="master_param"):  # DCP's CheckpointException
            load(plain_model, plain, tmp_path / "ckpt")
        return
    with pytest.raises(ValueError, match="by DCP's default planner"):  # cast into the template's dtype: refused
        load(plain_model, plain, tmp_path / "ckpt")  # (tests/unit/test_cast_loads.py: the whole line)


def test_exact_load_planner_keeps_dcp_s_refusal_of_any_other_missing_key(tmp_path):
    model, opt = build(torch.bfloat16, master_weights=True)
    run_steps(opt, list(model.parameters()), 0, 1)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.save(
        {"model": msd, "optim": {k: v for k, v in osd.items() if not k.endswith(".exp_avg")}},
        checkpoint_id=str(tmp_path),
    )
    other, other_opt = build(torch.bfloat16, 1, master_weights=True)
    with pytest.raises(BaseException, match=r"Missing key in checkpoint state_dict: optim\.state\..*\.exp_avg"):
        load(other, other_opt, tmp_path, ExactLoadPlanner())


def test_a_bf16_state_exported_one_at_a_time_is_a_copy():
    """state_dict_keep_bf16 with the per-state export (chunk_bytes=0): the exported BF16 moment is not the live
    state (a later step would change the checkpoint's values)."""
    params = make_params(torch.float32)
    opt = PortableFusedAdam(
        params, lr=1e-2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
        state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=0, state_dict_keep_bf16=True,
    )  # fmt: skip
    run_steps(opt, params, 0, 2)
    sd = opt.state_dict()
    saved = deep_clone(sd)
    assert sd["state"][0]["exp_avg"].dtype == torch.bfloat16
    run_steps(opt, params, 2, 1)
    for k, states in saved["state"].items():
        for name, value in states.items():
            assert_bitwise(sd["state"][k][name], value, f"{k}.{name} after a step")


@pytest.mark.parametrize("chunk_bytes", [None, 0], ids=["chunked", "one state at a time"])
def test_capturable_step_and_lr_are_exported_as_copies(chunk_bytes):
    """With offload, chunked or not, the group's lr and step tensors are exported as copies: a scheduler's in-place
    write and a step after the export leave the exported values as they were."""
    params = make_params(torch.float32)
    offload = dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=chunk_bytes)
    opt = PortableFusedAdam(params, lr=1e-2, capturable=True, **offload)
    run_steps(opt, params, 0, 2)
    sd = opt.state_dict()
    opt.param_groups[0]["lr"].fill_(0.5)  # as LambdaLR writes a capturable lr
    run_steps(opt, params, 2, 1)
    assert float(sd["param_groups"][0]["lr"]) == pytest.approx(1e-2) and int(sd["param_groups"][0]["step"]) == 2


def test_capturable_bias_corrections_are_the_fp32_values_of_the_host_path():
    """The kernels round 1 - beta**step (computed in double) to FP32 in both modes: a capturable group's
    corrections are FP32 tensors equal to the host path's, not float64 values a few ulps away."""
    group = {"betas": (0.9, 0.95), "bias_correction": True, "lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8}
    for step in (1, 7, 1000):
        host = group_scalars({**group, "step": step}, torch.device("cpu"))
        capturable = group_scalars({**group, "step": torch.tensor([step], dtype=torch.int)}, torch.device("cpu"))
        for name in ("bc1", "bc2"):
            assert capturable[name].dtype == torch.float32, name
            assert float(capturable[name]) == host[name] == f32(host[name]), (name, step)


def test_docs_exact_load_snippet_runs_as_written(tmp_path):
    """docs/export.md's block, in the README loop's setting: a remainders checkpoint into an FP32 master."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    block = re.search(r"<!-- export:exact-load -->\n```python\n(.*?)```", text, re.S).group(1)
    model, saved = build(torch.bfloat16, **MASTERS["remainders"])
    run_steps(saved, list(model.parameters()), 0, 2)
    save(model, saved, tmp_path)
    resumed_model, opt = build(torch.bfloat16, 3, **MASTERS["fp32 master"])
    exec(compile(block, "docs/export.md", "exec"), {"model": resumed_model, "opt": opt, "ckpt": str(tmp_path)})
    exported = opt.state_dict()["state"]
    for i, q in enumerate(model.parameters()):
        want = join_bf16_remainder(q.detach(), saved.state[q]["master_param"])
        assert_bitwise(exported[i]["master_param"], want, f"param {i}: the saved FP32 master")


@pytest.mark.parametrize("param", ["float32", "float16"])
def test_remainders_for_a_parameter_no_longer_bf16_are_refused_in_one_line_and_nothing_changes(param, tmp_path):
    """int16 remainders make a master only with a BF16 parameter: into the FP32 master of an FP32 or FP16 parameter
    (joined with an FP16 parameter's bits they would make a garbage master) they are refused before anything is
    loaded, naming the state, the saved format and the live one."""
    model, opt = build(torch.bfloat16, **MASTERS["remainders"])
    run_steps(opt, list(model.parameters()), 0, 2)
    save(model, opt, tmp_path)
    # offloaded: a template that aliases no live state (TE's own export aliases FP32 states, which DCP then writes)
    live_model, live = build(getattr(torch, param), 1, **MASTERS["fp32 master"], state_dict_cpu_offload=True)
    run_steps(live, list(live_model.parameters()), 0, 1)
    before = LiveSnapshot.take(live)
    with pytest.raises(ValueError) as info:
        load(live_model, live, tmp_path, ExactLoadPlanner())
    assert str(info.value) == (
        "load_state_dict: group 0, parameter 0: master_param is saved as int16 remainders, which only a "
        f"BF16 parameter's master can be; this parameter is {param}, its master an FP32 master: not convertible"
    )
    LiveSnapshot.take(live).assert_same(before)  # (DCP itself reads the model's tensors in place: they are read)


def test_a_conversion_still_to_apply_is_copied_with_the_optimizer_and_owns_its_saved_tensor():
    """A load's pending join survives copy.deepcopy (the copy converts from its own, loaded parameters), and it
    keeps its own copy of the saved remainders: the dictionary it was loaded from may be another optimizer's live
    state (TE's export aliases it), which that optimizer's later steps change."""
    params = make_params(torch.bfloat16)
    src = PortableFusedAdam(params, lr=1e-2, **MASTERS["remainders"])
    run_steps(src, params, 0, 2)
    masters = [join_bf16_remainder(p.detach(), src.state[p]["master_param"]) for p in params]
    dst_params = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    dst = PortableFusedAdam(dst_params, lr=1e-2, **MASTERS["fp32 master"])
    dst.load_state_dict(src.state_dict())  # not offloaded: the remainders are src's live tensors
    with torch.no_grad():  # the model, loaded after the optimizer
        for p, q in zip(dst_params, params):
            p.copy_(q)
    run_steps(src, params, 2, 2)  # src's remainders change in place
    twin = copy.deepcopy(dst)
    for opt in (dst, twin):
        exported = opt.state_dict()["state"]
        for i, master in enumerate(masters):
            assert_bitwise(exported[i]["master_param"], master, f"param {i}: the master saved at the load")


def test_exact_load_planner_without_flattening_puts_the_saved_dtype_in_the_caller_s_dictionary(tmp_path):
    """With ``flatten_state_dict=False`` (a flat dictionary) the caller's dictionary gets the saved-dtype tensor."""
    saved = {"optim.state.w.master_param": torch.arange(-3, 3, dtype=torch.int16)}
    dcp.save(saved, checkpoint_id=str(tmp_path))
    template = {"optim.state.w.master_param": torch.zeros(6)}
    dcp.load(template, checkpoint_id=str(tmp_path), planner=ExactLoadPlanner(flatten_state_dict=False))
    assert_bitwise(template["optim.state.w.master_param"], saved["optim.state.w.master_param"], "read as saved")
