"""``copy.deepcopy`` and pickling of an optimizer keep every option and give the copy its own exporter.

torch's ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``: with it, a deep copy
would lose its export options, its exporter and the FusedAdam attributes (``master_weights``,
``name_to_dtype_map``), and its first ``state_dict()`` or ``step()`` would raise ``AttributeError``.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from optim_factory import PortableFusedAdam
from tests.helpers import assert_state_dicts_bitwise, make_params, run_steps

OPTIONS = dict(
    lr=1e-2,
    weight_decay=0.1,
    master_weights=True,
    exp_avg_dtype=torch.bfloat16,
    exp_avg_sq_dtype=torch.bfloat16,
    state_dict_cpu_offload=True,
    state_dict_offload_chunk_bytes=1 << 20,
    state_dict_offload_reuse_buffers=True,
    state_dict_keep_bf16=True,
    state_dict_offload_background=True,
)


def _pickled(opt):
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", [copy.deepcopy, _pickled], ids=["deepcopy", "pickle"])
def test_a_copy_exports_and_steps_as_the_original(how):
    params = make_params(torch.bfloat16)
    opt = PortableFusedAdam(params, **OPTIONS)
    run_steps(opt, params, 0, 2)
    with opt.deferred_state_dict():  # a copy taken inside the context does not defer
        twin = how(opt)
    assert twin.export_options == opt.export_options and twin.master_weights
    assert twin.state_exporter is not opt.state_exporter
    exported = twin.state_dict()
    assert not twin.state_dict_pending  # filled before it returned: the copy is not inside the context
    assert_state_dicts_bitwise(exported, opt.state_dict(), "after the copy")
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert all(a is not b for a, b in zip(twin_params, params))  # the copy owns copies of the parameters
    run_steps(opt, params, 2, 2)
    run_steps(twin, twin_params, 2, 2)
    assert_state_dicts_bitwise(twin.state_dict(), opt.state_dict(), "after two more steps each")
    for a, b in zip(twin_params, params):
        assert torch.equal(a, b)
