"""The checkpoint contract with Transformer Engine on CUDA (one GPU, DCP in one process): our FusedAdam (TE's kernels)
and TE's own class beside it. Keys that survive any number of resumes for every configuration the constructor
accepts; every pair of master formats (and two moment changes) saved by either class and resumed into ours through
``ExactLoadPlanner``, once and twice, bitwise the in-memory conversion; TE's own class loading what ours saves, and
the master of an FP32 parameter kept by both."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from optim_factory.checkpoint import ExactLoadPlanner, SafeFileSystemReader, prepare_load
from tests.helpers import assert_bitwise, deep_clone, make_params, run_steps
from tests.unit.test_formats import FLAT, MASTERS, MOMENTS, PARAMS, keys, save  # the same configurations, on CUDA

HP = {"lr": 1e-2, "weight_decay": 0.1}
FORMATS = {
    **MASTERS,
    "bf16 moments": {"master_weights": True, "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
}
PAIRS = [(a, b) for a in MASTERS for b in MASTERS if a != b] + [
    ("fp32 master", "bf16 moments"),
    ("bf16 moments", "fp32 master"),
]


def classes() -> dict:
    from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam

    from optim_factory import FusedAdam

    return {"ours": FusedAdam, "TE's": TEFusedAdam}


class Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        self.params = torch.nn.ParameterList(make_params(dtype, seed, device="cuda"))


def build(cls, dtype: torch.dtype, seed: int = 0, **options):
    """A model and ``cls`` over it (``None``: a combination the constructor refuses)."""
    model = Model(dtype, seed)
    try:
        return model, cls(model.parameters(), **HP, **options)
    except (ValueError, RuntimeError, AssertionError):  # TE's refusals are asserts and RuntimeErrors
        return None


def load(model, opt, path) -> None:
    prepare_load(opt)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=ExactLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)


def assert_same(got, want, what: str) -> None:
    (gm, go), (wm, wo) = got, want
    for a, b in zip(gm.parameters(), wm.parameters()):
        assert_bitwise(a, b, f"{what}: parameter")
    exported = wo.state_dict()["state"]
    for k, states in go.state_dict()["state"].items():
        assert sorted(states) == sorted(exported[k]), f"{what}: keys of {k}"
        for name, value in states.items():
            assert_bitwise(value, exported[k][name], f"{what}: {k}.{name}")


@pytest.mark.parametrize("param", PARAMS)
@pytest.mark.parametrize("master", MASTERS)
def test_te_keys_survive_any_number_of_dcp_resumes(param, master, tmp_path):
    """Ours on TE's kernels, every moment dtype, capturable or not: the keys after each of two resumes are a fresh
    optimizer's after initialize_states(), and the twice-resumed run's checkpoint loads bitwise."""
    FusedAdam = classes()["ours"]
    built = 0
    for (moment, moment_dtype), capturable in itertools.product(MOMENTS.items(), (False, True)):
        options = dict(MASTERS[master], exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype)
        options["capturable"] = capturable
        first = build(FusedAdam, PARAMS[param], **options)
        if first is None:
            continue
        built += 1
        what = f"{param} params, {master}, {moment} moments, capturable={capturable}"
        fresh = build(FusedAdam, PARAMS[param], 7, **options)[1]
        fresh.initialize_states()
        run_steps(first[1], list(first[0].parameters()), 0, 2)
        save(*first, tmp_path / what / "0")
        run = first
        for resume in (1, 2):
            run = build(FusedAdam, PARAMS[param], 5, **options)
            load(*run, tmp_path / what / str(resume - 1))
            assert keys(run[1]) == keys(fresh), f"{what}: keys after resume {resume}"
            run_steps(run[1], list(run[0].parameters()), 1 + resume, 1)
            save(*run, tmp_path / what / str(resume))
        again = build(FusedAdam, PARAMS[param], 9, **options)
        load(*again, tmp_path / what / "2")
        assert_same(again, run, f"{what}: the twice-resumed run's checkpoint")
    assert built, f"the constructor refused every configuration of {param} params with {master}"


@pytest.mark.parametrize("writer", ["ours", "TE's"])
@pytest.mark.parametrize("saved,live", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_a_changed_format_resumes_into_ours_exactly_twice(writer, saved, live, tmp_path):
    """A checkpoint of ``writer`` in ``saved`` resumed into ours in ``live``: after 2 steps, and after a second
    resume and 2 more steps, bitwise the run that converted in memory (``load_state_dict``, model first)."""
    cls = classes()
    FusedAdam = cls["ours"]
    first = build(cls[writer], torch.bfloat16, **FORMATS[saved])
    run_steps(first[1], list(first[0].parameters()), 0, 3)
    save(*first, tmp_path / "a")

    want = build(FusedAdam, torch.bfloat16, 3, **FORMATS[live])
    with torch.no_grad():
        for p, q in zip(want[0].parameters(), first[0].parameters()):
            p.copy_(q)
    want[1].load_state_dict(deep_clone(first[1].state_dict()))

    got = build(FusedAdam, torch.bfloat16, 4, **FORMATS[live])
    load(*got, tmp_path / "a")
    for m, o in (got, want):
        run_steps(o, list(m.parameters()), 3, 2)
    assert_same(got, want, "resumed once")
    save(*got, tmp_path / "b")
    again = build(FusedAdam, torch.bfloat16, 5, **FORMATS[live])
    load(*again, tmp_path / "b")
    for m, o in (again, want):
        run_steps(o, list(m.parameters()), 5, 2)
    assert_same(again, want, "resumed twice")


@pytest.mark.parametrize("writer,reader", [("ours", "TE's"), ("TE's", "ours")])
@pytest.mark.parametrize("param", ["fp32", "bf16"])
def test_te_s_class_and_ours_resume_each_other_with_the_same_keys(writer, reader, param, tmp_path):
    """Same configuration, master weights on (an FP32 parameter's master included, which TE keeps): the reader's
    keys after the load are the writer's, its next checkpoint loads into the writer's class again, bitwise."""
    cls = classes()
    options = {"master_weights": True, "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}
    first = build(cls[writer], PARAMS[param], **options)
    run_steps(first[1], list(first[0].parameters()), 0, 3)
    save(*first, tmp_path / "a")
    second = build(cls[reader], PARAMS[param], 1, **options)
    load(*second, tmp_path / "a")
    assert keys(second[1]) == keys(first[1])
    run_steps(second[1], list(second[0].parameters()), 3, 1)
    save(*second, tmp_path / "b")
    third = build(cls[writer], PARAMS[param], 2, **options)
    load(*third, tmp_path / "b")
    assert keys(third[1]) == keys(first[1])
    assert_same(third, second, "back in the writer's class")
