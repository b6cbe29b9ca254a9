"""No-decay groups by module type, by dimension and by name (issue 16, item 4).

Name patterns alone would give GPT-2 style names (``wte``, ``wpe``), an embedding not named "embed" and a norm
not named "norm" weight decay, and the default run would log a default pattern matching nothing.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from optim_factory.config import DEFAULT_NO_DECAY
from optim_factory.factory import build_optimizer
from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE
from recipes.config import ModelConfig
from recipes.model import DecoderLM


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 2 * d)


class GPT2Style(nn.Module):
    """GPT-2's names (wte, wpe, ln_f), plus an embedding and an RMSNorm whose names say nothing, a 1-D gain and
    a weight-tied head."""

    def __init__(self, d: int = 8, vocab: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(8, d)
        self.segments = nn.Embedding(2, d)  # an embedding not named "embed"
        self.h = nn.ModuleList([Block(d), Block(d)])
        self.final = nn.RMSNorm(d)  # not named "norm"
        self.gate = nn.Parameter(torch.ones(d))  # a bare 1-D parameter
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: listed once, as wte.weight


DECAYED = {"h.0.c_attn.weight", "h.0.c_fc.weight", "h.1.c_attn.weight", "h.1.c_fc.weight"}


def names_by_decay(opt: torch.optim.Optimizer, model: nn.Module) -> tuple[set[str], set[str]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    every = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(every) == sorted(name_of) and len(set(every)) == len(every)  # each parameter exactly once
    decay = {name_of[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    return decay, set(name_of.values()) - decay


def group_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("param group")]


def test_gpt2_names_embeddings_norms_and_1d_get_no_decay(caplog):
    model = GPT2Style()
    with caplog.at_level(logging.INFO, logger="optim_factory.factory"):
        opt = build_optimizer({"weight_decay": 0.1}, model)
    decay, no_decay = names_by_decay(opt, model)
    assert decay == DECAYED
    assert {"wte.weight", "wpe.weight", "segments.weight", "final.weight", "gate", "ln_f.weight"} <= no_decay
    assert group_lines(caplog) == [
        "param group 0 [default]: 4 tensors, 640 elements, lr=0.001, weight_decay=0.1",
        "param group 1 [default, no decay: nn.Embedding (3), nn.LayerNorm (9), nn.RMSNorm (1), 1-D (5)]: "
        "18 tensors, 376 elements, lr=0.001, weight_decay=0",
    ]
    # the default patterns that match nothing here ('norm', 'embed') stay quiet
    assert not [r for r in caplog.records if "matches no parameter" in r.getMessage()]


def test_default_model_run_logs_no_unused_default_pattern(caplog):
    """The recipe's own model: no default pattern is reported as matching nothing (issue 16)."""
    model = DecoderLM(ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8))
    with caplog.at_level(logging.INFO, logger="optim_factory.factory"):
        build_optimizer({"weight_decay": 0.1}, model)
    assert not [r for r in caplog.records if "matches no parameter" in r.getMessage()]


def test_patterns_add_to_the_module_rules_and_say_so(caplog):
    model = GPT2Style()
    cfg = {"weight_decay": 0.1, "param_groups": {"no_decay": ["c_fc"]}}
    with caplog.at_level(logging.INFO, logger="optim_factory.factory"):
        opt = build_optimizer(cfg, model)
    decay, _ = names_by_decay(opt, model)
    assert decay == {"h.0.c_attn.weight", "h.1.c_attn.weight"}
    assert "pattern 'c_fc' (2)" in group_lines(caplog)[1]


def test_a_user_pattern_that_matches_nothing_is_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="optim_factory.factory"):
        build_optimizer({"param_groups": {"no_decay": ["lm_haed", *DEFAULT_NO_DECAY]}}, GPT2Style())
    unused = [r for r in caplog.records if "matches no parameter" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in unused] == [
        (logging.WARNING, "optim.param_groups.no_decay[0]='lm_haed' matches no parameter")
    ]


def test_named_pairs_get_the_dimension_and_name_rules_only(caplog):
    """Without the module, an embedding's 2-D weight cannot be told from a linear one: only 1-D and names, with
    a warning that says so."""
    model = GPT2Style()
    with caplog.at_level(logging.INFO, logger="optim_factory"):
        opt = build_optimizer({"weight_decay": 0.1}, list(model.named_parameters()))
    decay, _ = names_by_decay(opt, model)
    assert decay == DECAYED | {"wte.weight", "wpe.weight", "segments.weight"}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("optim.param_groups.no_decay_auto: given (name, parameter) pairs")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="optim_factory"):
        build_optimizer({"weight_decay": 0.1}, model)  # the module: the rule applies, no warning
        build_optimizer({"weight_decay": 0.0}, list(model.named_parameters()))  # nothing decays anyway
        named = {"weight_decay": 0.1, "param_groups": {"no_decay": ["wte", "wpe", *DEFAULT_NO_DECAY]}}
        build_optimizer(named, list(model.named_parameters()))  # the advice taken: the embeddings by name
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_switch_off_leaves_the_name_patterns_alone():
    model = GPT2Style()
    cfg = {"weight_decay": 0.1, "param_groups": {"no_decay_auto": False, "no_decay": [r"^w"]}}
    decay, no_decay = names_by_decay(build_optimizer(cfg, model), model)
    assert no_decay == {"wte.weight", "wpe.weight"}


def test_overrides_keep_their_no_decay_split():
    model = GPT2Style()
    cfg = {"weight_decay": 0.1, "param_groups": {"overrides": [{"pattern": r"^h\.1\.", "lr_mult": 0.5}]}}
    opt = build_optimizer(cfg, model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    half = [g for g in opt.param_groups if g["lr"] == pytest.approx(5e-4)]
    assert {(name_of[id(p)], g["weight_decay"]) for g in half for p in g["params"]} == {
        ("h.1.c_attn.weight", 0.1),
        ("h.1.c_fc.weight", 0.1),
        ("h.1.c_attn.bias", 0.0),
        ("h.1.c_fc.bias", 0.0),
        ("h.1.ln_1.weight", 0.0),
        ("h.1.ln_1.bias", 0.0),
        ("h.1.ln_2.weight", 0.0),
        ("h.1.ln_2.bias", 0.0),
    }


@pytest.mark.parametrize(
    "module",
    [nn.GroupNorm(2, 4), nn.BatchNorm1d(4), nn.InstanceNorm2d(4, affine=True), nn.LayerNorm([4, 4])],
    ids=lambda m: type(m).__name__,
)
def test_every_norm_type(module):
    """nn.LayerNorm([4, 4]) has a 2-D weight: only its type keeps it out of weight decay."""
    model = nn.Sequential(nn.Linear(4, 4), module)
    decay, _ = names_by_decay(build_optimizer({"weight_decay": 0.1}, model), model)
    assert decay == {"0.weight"}


@pytest.mark.skipif(not TE_AVAILABLE, reason="Transformer Engine is not importable")
def test_te_norms():
    import transformer_engine.pytorch as te

    model = nn.ModuleDict({"a": te.LayerNorm(8), "b": te.RMSNorm(8), "c": nn.Linear(8, 8, bias=False)}).cuda()
    decay, _ = names_by_decay(build_optimizer({"weight_decay": 0.1}, model), model)
    assert decay == {"c.weight"}
