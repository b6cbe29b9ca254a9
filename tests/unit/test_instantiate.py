"""Our optimizers from a Hydra ``_target_`` block: docs/drop-in.md's block, run (the frameworks' own paths:
tests/integrations/).

``hydra.utils.instantiate({"_target_": "optim_factory.PortableFusedAdam", "exp_avg_dtype": "bf16"}, ...)``
builds the optimizer, with the dtype and size strings converted (``torch.bfloat16`` / ``bfloat16``,
``state_dict_offload_chunk_bytes: 64MiB``) rather than refused ("FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg").
"""

from __future__ import annotations

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE
from tests.helpers import drop_in_block

TARGETS = [
    pytest.param("optim_factory.PortableFusedAdam", id="portable"),
    pytest.param(
        "optim_factory.FusedAdam",
        id="te",
        marks=pytest.mark.skipif(not TE_AVAILABLE, reason="Transformer Engine is not importable"),
    ),
]


def model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(device=device, dtype=torch.bfloat16)


def doc_yaml(target: str) -> str:
    """The doc's YAML text with its ``_target_`` set to ``target``."""
    text = drop_in_block("target-yaml")
    assert "_target_: optim_factory.FusedAdam " in text
    return text.replace("_target_: optim_factory.FusedAdam ", f"_target_: {target} ")


def doc_block(target: str):
    """The doc's ``optimizer`` block as Hydra composes it (OmegaConf's YAML loader reads 1e-8 as a float)."""
    return OmegaConf.create(doc_yaml(target)).optimizer


def check_built(opt: torch.optim.Optimizer, target: str) -> None:
    """The doc block's values, as the optimizer holds them (strings converted, nothing dropped)."""
    assert type(opt).__name__ == target.rsplit(".", 1)[1]
    g = opt.param_groups[0]
    assert (float(g["lr"]), g["betas"], g["eps"], g["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-8, 0.1)
    assert opt.exp_avg_dtype == opt.exp_avg_sq_dtype == torch.bfloat16
    assert opt.master_weights is True and opt.store_param_remainders is True
    assert opt.state_dict_cpu_offload is True and opt.state_dict_offload_chunk_bytes == 64 << 20


def step_once(opt: torch.optim.Optimizer, m: torch.nn.Module) -> None:
    m(torch.ones(2, 8, dtype=torch.bfloat16, device=next(m.parameters()).device)).float().sum().backward()
    opt.step()
    sd = opt.state_dict()  # the CPU-offloaded export the block asked for
    assert all(v.device.type == "cpu" for s in sd["state"].values() for v in s.values() if torch.is_tensor(v))


@pytest.mark.parametrize("target", TARGETS)
def test_doc_yaml_block_through_hydra_instantiate(target):
    m = model("cuda" if target.endswith(".FusedAdam") else "cpu")
    cfg = doc_block(target)  # betas arrive as a ListConfig, dtypes and sizes as strings
    opt = instantiate(cfg, params=m.parameters())
    check_built(opt, target)
    step_once(opt, m)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16", "BF16"])
def test_issue_16_spellings(spelling):
    cfg = {"_target_": "optim_factory.PortableFusedAdam", "exp_avg_dtype": spelling, "exp_avg_sq_dtype": "fp8"}
    opt = instantiate(cfg, params=model().parameters())
    assert opt.exp_avg_dtype == torch.bfloat16 and opt.exp_avg_sq_dtype == torch.uint8


def test_bad_value_in_a_block_names_the_key():
    cfg = {"_target_": "optim_factory.PortableFusedAdam", "exp_avg_dtype": "fp64"}
    with pytest.raises(InstantiationException, match=r"exp_avg_dtype='fp64': FusedAdam only supports"):
        instantiate(cfg, params=model().parameters())


@pytest.mark.skipif(TE_AVAILABLE, reason="checks the message without Transformer Engine")
def test_te_target_without_te_says_what_to_install():
    with pytest.raises(InstantiationException, match="needs NVIDIA Transformer Engine"):
        instantiate(doc_block("optim_factory.FusedAdam"), params=model().parameters())
