"""``initialize_states()``: the states a first step creates, without gradients, so that DCP's ``get_state_dict``
on a fresh optimizer (a resume's template) does not run its step on zero gradients; a resume through it loads
every state and the step count bitwise."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from optim_factory import PortableFusedAdam

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
KINDS = {
    "bf16-master": dict(master_weights=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
    "fp16-master": dict(master_weights=True, master_weight_dtype="fp16"),
    "remainders": dict(master_weights=True, store_param_remainders=True),
    "offload": dict(master_weights=True, exp_avg_dtype="bf16", state_dict_cpu_offload=True),
}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)


def _optimizer(model: torch.nn.Module, kind: str) -> PortableFusedAdam:
    with warnings.catch_warnings():  # "no memory effect here": the parameters are not on a GPU
        warnings.simplefilter("ignore", UserWarning)
        return PortableFusedAdam(model.parameters(), lr=1e-2, **KINDS[kind])


def _train(model, opt, steps: int) -> None:
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for _ in range(steps):
        model(batch).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _states(opt) -> list[tuple]:
    return [(name, value.clone()) for p in opt.state for name, value in sorted(opt.state[p].items())] + [
        g["step"] for g in opt.param_groups
    ]


def _assert_equal(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, tuple):
            assert x[0] == y[0] and x[1].dtype == y[1].dtype and torch.equal(x[1], y[1]), x[0]
        else:
            assert x == y


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_template_of_an_initialized_optimizer_runs_no_step_and_allocates_no_gradient(kind):
    model = _model()
    opt = _optimizer(model, kind)
    steps = []
    opt.register_step_pre_hook(lambda o, args, kwargs: steps.append([p.grad is not None for p in model.parameters()]))
    get_state_dict(model, opt, options=OPTIONS)
    assert steps == [[True] * 4]  # DCP's own initialisation: a step on zero gradients, allocated for it
    fresh = _optimizer(model, kind)
    fresh.register_step_pre_hook(lambda o, args, kwargs: steps.append("stepped"))
    fresh.initialize_states()
    _, osd = get_state_dict(model, fresh, options=OPTIONS)
    assert steps == [[True] * 4] and all(p.grad is None for p in model.parameters())
    assert any(k.endswith(".step") for k in osd), sorted(osd)[:6]  # the template carries the step count


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_initialized_states_equal_those_of_dcp_s_initialisation_and_a_first_step_counts_one(kind):
    model, other = _model(), _model()  # the same parameters; each optimizer changes only its own
    by_dcp = _optimizer(other, kind)
    get_state_dict(other, by_dcp, options=OPTIONS)  # DCP: a step on zero gradients with lr 0
    mine = _optimizer(model, kind)
    mine.initialize_states()
    assert [g["step"] for g in mine.param_groups] == [0]
    _assert_equal(_states(mine)[:-1], _states(by_dcp)[:-1])  # every state bitwise; DCP's step counted 1
    if KINDS[kind].get("master_weight_dtype") is None and not KINDS[kind].get("store_param_remainders"):
        masters = [opt_state["master_param"] for opt_state in mine.state.values()]
        assert all(m.dtype == torch.float32 for m in masters)
        assert all(torch.equal(m, p.float()) for m, p in zip(masters, model.parameters(), strict=True))
    a, b = _model(), _model()
    first, second = _optimizer(a, kind), _optimizer(b, kind)
    second.initialize_states()
    _train(a, first, 2)
    _train(b, second, 2)
    _assert_equal(_states(second), _states(first))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_resume_through_initialize_states_loads_every_state_and_the_step_count_bitwise(kind, tmp_path):
    model = _model()
    opt = _optimizer(model, kind)
    _train(model, opt, 3)
    msd, osd = get_state_dict(model, opt, options=OPTIONS)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
        again = _model(seed=1)
        fresh = _optimizer(again, kind)
        fresh.initialize_states()
        msd2, osd2 = get_state_dict(again, fresh, options=OPTIONS)
        state = {"model": msd2, "optim": osd2}
        dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(again, fresh, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    assert [g["step"] for g in fresh.param_groups] == [3]
    _assert_equal(_states(fresh), _states(opt))
    _train(model, opt, 2)
    _train(again, fresh, 2)
    _assert_equal(_states(fresh), _states(opt))
    assert all(torch.equal(x, y) for x, y in zip(model.parameters(), again.parameters(), strict=True))


def test_states_that_exist_are_kept():
    model = _model()
    opt = _optimizer(model, "bf16-master")
    _train(model, opt, 2)
    before = _states(opt)
    opt.initialize_states()
    _assert_equal(_states(opt), before)


def test_every_group_gets_a_step_count_an_empty_one_too():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = PortableFusedAdam([{"params": list(model.parameters())}, {"params": []}], lr=1e-2, master_weights=True)
    opt.initialize_states()
    assert [g["step"] for g in opt.param_groups] == [0, 0]
    _train(model, opt, 1)
    assert [g["step"] for g in opt.param_groups] == [1, 1]  # as a first step counts without the call
