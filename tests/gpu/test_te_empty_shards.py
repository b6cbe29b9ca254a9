"""optim_factory.FusedAdam (TE) with empty tensors: 0-element parameters on one GPU, and empty FSDP2 shards on
two GPUs (a 1-element bias). Needs CUDA and Transformer Engine; skipped otherwise (see conftest.py).

    python -m pytest -q tests/gpu/test_te_empty_shards.py
"""

from __future__ import annotations

import pytest
import torch

from optim_factory.optimizers.export import export_state, load_exported_state
from tests.distributed.empty_shards import steps
from tests.gpu.test_te_distributed import torchrun
from tests.helpers import (
    LIFECYCLE_CONFIGS,
    assert_bitwise,
    assert_state_dicts_bitwise,
    clone_params,
    deep_clone,
    grads_for,
    make_params,
)

DEV = "cuda"
HP = dict(lr=1e-2, weight_decay=0.1)
SHAPES = [(64, 33), (5,), (3, 4, 2), (1000,)]
# 0-element parameters first, among and last among the others (a trailing empty tensor is the case a
# multi-tensor launch loop can skip over), as (position in the full list, shape)
EMPTY = [(0, (0,)), (3, (0, 4)), (6, (0,))]
CASES = [pytest.param(n, d, kw, id=n) for n, d, kw in LIFECYCLE_CONFIGS]


def with_empties(dtype: torch.dtype, nonempty: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    params = list(nonempty)
    for at, shape in EMPTY:
        params.insert(at, torch.nn.Parameter(torch.empty(shape, device=DEV, dtype=dtype)))
    return params


def step(opts_and_params, start: int, n: int, dtype: torch.dtype) -> None:
    """The same gradients for the non-empty parameters of every run; empty ones get empty gradients."""
    for s in range(start, start + n):
        for opt, params in opts_and_params:
            grads = iter(grads_for(s, SHAPES, dtype))
            for p in params:
                p.grad = torch.empty_like(p) if p.numel() == 0 else next(grads).to(DEV)
            opt.step()
            opt.zero_grad()


def assert_same_as_reference(ours, ours_params, theirs, theirs_params, what: str) -> None:
    """Non-empty parameters, their live states and their per-state exports bitwise equal TE's own run."""
    nonempty = [p for p in ours_params if p.numel() > 0]
    assert len(nonempty) == len(theirs_params)
    for a, b in zip(nonempty, theirs_params):
        assert_bitwise(a, b, f"{what}: param")
        assert ours.state[a].keys() == theirs.state[b].keys(), what
        for name in ours.state[a]:
            assert_bitwise(ours.state[a][name], theirs.state[b][name], f"{what}: {name}")
    ex_ours, ex_theirs = export_state(ours, cpu_offload=True), export_state(theirs, cpu_offload=True)
    index = [i for i, p in enumerate(ours_params) if p.numel() > 0]
    for j, i in enumerate(index):
        for name, t in ex_theirs["state"][j].items():
            assert_bitwise(ex_ours["state"][i][name], t, f"{what}: export {name}")
    assert steps(ours.param_groups) == steps(theirs.param_groups), what


@pytest.mark.parametrize("name,dtype,kw", CASES)
def test_zero_element_parameters_step_export_load_continue_like_te_without_them(name, dtype, kw):
    from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam

    from optim_factory import FusedAdam

    nonempty = make_params(dtype, shapes=SHAPES, device=DEV)
    twin = clone_params(nonempty)
    params = with_empties(dtype, nonempty)
    ours, theirs = FusedAdam(params, **HP, **kw), TEFusedAdam(twin, **HP, **kw)
    step([(ours, params), (theirs, twin)], 0, 3, dtype)
    assert_same_as_reference(ours, params, theirs, twin, f"{name}, 3 steps")
    for (_, shape), p in zip(EMPTY, [q for q in params if q.numel() == 0]):
        assert p.shape == shape and len(ours.state[p]) >= 2, f"{name}: states of an empty parameter"
        for state in ours.state[p].values():
            assert state.shape == shape, f"{name}: empty state {state.shape}"

    # exports: TE's own state_dict() and the per-state CPU export; each loads into a fresh optimizer
    te_sd, per_state = deep_clone(ours.state_dict()), export_state(ours, cpu_offload=True)
    for k, st in per_state["state"].items():
        for state_name, t in st.items():
            assert_bitwise(te_sd["state"][k][state_name], t, f"{name}: state_dict vs export {k}.{state_name}")
    restored = []
    for how in ("load_state_dict", "load_exported_state"):
        fresh = clone_params(params)
        opt = FusedAdam(fresh, **HP, **kw)
        if how == "load_state_dict":
            opt.load_state_dict(deep_clone(te_sd))
        else:
            load_exported_state(opt, per_state)
        assert_state_dicts_bitwise(per_state, export_state(opt, cpu_offload=True), f"{name}: {how}")
        restored.append((how, opt, fresh))

    # continue: every run 2 more steps; the loaded ones equal ours bitwise, ours still equals TE's
    step([(ours, params), (theirs, twin)] + [(o, p) for _, o, p in restored], 3, 2, dtype)
    assert_same_as_reference(ours, params, theirs, twin, f"{name}, 5 steps")
    for how, opt, fresh in restored:
        for a, b in zip(fresh, params):
            assert_bitwise(a, b, f"{name}: {how}, continued: param")
        assert_state_dicts_bitwise(
            export_state(ours, cpu_offload=True), export_state(opt, cpu_offload=True), f"{name}: {how}, continued"
        )


# FP16 and FP8 states (moments and master), and int16 remainders (sharded only: no backend gathers int16)
TWO_GPU_CONFIGS = [
    "fp16-moments",
    "fp8-moments",
    "fp8-fp16-mixed",
    "bf16-params-fp16-master-fp16-fp8-moments",
    "bf16-params-remainders",
]


@pytest.mark.two_gpus
def test_fsdp2_one_element_bias_fp16_fp8_dcp_flatten_save_load_continue(tmp_path):
    """tests/distributed/empty_shards.py's lifecycle on 2 GPUs with TE: FSDP2 leaves rank 1's shard of a
    1-element bias (and of a 1-row parameter) empty; DCP's flattened export equals ``export_state(opt,
    cpu_offload=True)`` bitwise, saves, loads into a fresh model and optimizer, and continues bitwise; the full
    gathered state dict equals a one-GPU run bitwise."""
    configs = ",".join(TWO_GPU_CONFIGS)
    out = torchrun(2, "-m", "tests.distributed.run_worker", "empty_shards.lifecycle", "te", str(tmp_path), configs)
    assert out.count("empty_shards.lifecycle ok") == 2
