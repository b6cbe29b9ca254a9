"""``torch.amp.GradScaler`` with a capturable optimizer (``step(grad_scaler=...)`` unscales in the step).

``scaler.unscale_(opt)`` before ``scaler.step(opt)`` (the gradient-clipping pattern) unscales the gradients once:
unscaled twice, after 3 steps the parameters are 0.22 off ``torch.optim.Adam`` under the same scaler (TE 2.20.2 on
an H200: 0.275); without ``unscale_`` they agree to 4.5e-8. Tolerance: 1e-6, measured 4.5e-8 on CPU (FP32, the
portable twin's kernel arithmetic against torch's Adam).
"""

from __future__ import annotations

import pytest
import torch

from optim_factory import PortableFusedAdam

TOL = 1e-6
# torch 2.13: "GradScaler is going to stop passing itself as a keyword argument" (TE's step takes it so)
pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")


def against_adam(cls, unscale: bool, overflow_at: int | None = None, device: str = "cpu") -> tuple[float, list[int]]:
    """3 steps of ``cls`` (capturable, L2 weight decay) and of ``torch.optim.Adam``, each under its own
    GradScaler; the largest parameter difference and both step counts."""
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(4, 2).to(device), torch.nn.Linear(4, 2).to(device)
    ref.load_state_dict(model.state_dict())
    opt = cls(model.parameters(), lr=0.1, capturable=True, adam_w_mode=False, weight_decay=0.5)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1, weight_decay=0.5)
    scalers = [torch.amp.GradScaler(device, init_scale=1024.0) for _ in range(2)]
    for i in range(3):
        x = torch.randn(8, 4, device=device)
        for module, o, scaler in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            o.zero_grad()
            scaler.scale(module(x).square().sum()).backward()
            if i == overflow_at:
                next(module.parameters()).grad[0, 0] = float("inf")
            if unscale:
                scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(module.parameters(), 1e6)
            scaler.step(o)
            scaler.update()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return diff, [int(opt.param_groups[0]["step"]), int(ref_opt.state[next(ref.parameters())]["step"])]


@pytest.mark.parametrize("unscale", [False, True], ids=["scaled", "unscale_-first"])
@pytest.mark.parametrize("overflow_at", [None, 1], ids=["finite", "overflow-at-step-1"])
def test_capturable_step_unscales_once_and_skips_overflow(unscale, overflow_at):
    diff, steps = against_adam(PortableFusedAdam, unscale, overflow_at)
    assert diff < TOL, diff
    assert steps[0] == steps[1] == (3 if overflow_at is None else 2)
