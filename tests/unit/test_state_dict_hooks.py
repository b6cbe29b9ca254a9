"""torch's optimizer state-dict hooks run around the whole export and load, as on ``torch.optim`` optimizers.

The export and the load call torch's ``Optimizer.state_dict``/``load_state_dict`` inside; with torch's hooks run
there (TE's ``FusedAdam`` does), a state-dict post-hook would see the stored (scaled FP16) states and its changes
would be overwritten by the export, a load pre-hook would see no states and its changes would not be loaded, and a
load post-hook would run before any state is set.
"""

from __future__ import annotations

import pytest
import torch

from optim_factory import PortableFusedAdam
from tests.helpers import make_params, run_steps

MODES = {
    "te-export": {},
    "offload": dict(state_dict_cpu_offload=True),
    "chunked-reuse": dict(
        state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=1 << 20, state_dict_offload_reuse_buffers=True
    ),
}


def _trained(**options):
    params = make_params(torch.float32)
    opt = PortableFusedAdam(params, lr=1e-2, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.bfloat16, **options)
    run_steps(opt, params, 0, 2)
    return params, opt


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_hooks_see_and_change_the_export(mode):
    _, opt = _trained(**MODES[mode])
    expected = PortableFusedAdam.state_dict(opt)  # no hooks yet: the export
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))

    def post(o, sd):
        seen.append(sd["state"][0]["exp_avg"].dtype)
        return {**sd, "state": {k: {n: v.to(torch.bfloat16) for n, v in st.items()} for k, st in sd["state"].items()}}

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert seen == ["pre", torch.float32]  # not torch.float16, the stored (scaled) moment
    assert all(v.dtype == torch.bfloat16 for st in sd["state"].values() for v in st.values())  # not overwritten
    assert torch.equal(sd["state"][0]["exp_avg"], expected["state"][0]["exp_avg"].to(torch.bfloat16))


def test_load_hooks_change_what_is_loaded_and_see_the_loaded_states():
    _, saved = _trained()
    sd = saved.state_dict()
    params, opt = _trained()
    run_steps(opt, params, 2, 1)

    def zero_exp_avg(o, state_dict):
        state = {k: {**st, "exp_avg": torch.zeros_like(st["exp_avg"])} for k, st in state_dict["state"].items()}
        return {**state_dict, "state": state}

    loaded_steps = []
    opt.register_load_state_dict_pre_hook(zero_exp_avg)
    opt.register_load_state_dict_post_hook(lambda o: loaded_steps.append(o.param_groups[0]["step"]))
    opt.register_load_state_dict_post_hook(lambda o: loaded_steps.append(len(o.state)))
    opt.load_state_dict(sd)
    assert all(not st["exp_avg"].any() for st in opt.state.values())  # not the saved exp_avg: the hook counts
    assert loaded_steps == [2, len(params)]  # not [2, 0]: the states are set
    assert torch.equal(opt.state[params[0]]["exp_avg_sq"], saved.state[next(iter(saved.state))]["exp_avg_sq"])
