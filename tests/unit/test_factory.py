"""build_optimizer: every config composes and builds, every option reaches the optimizer, bad configs fail early."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import warnings
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ReadonlyConfigError

from optim_factory import PortableFusedAdam
from optim_factory.config import AdamWConfig, FusedAdamConfig, GroupOverride, ParamGroupsConfig, StateDtype
from optim_factory.factory import ConfigError, ValidatedOptim, build_optimizer, parse_dtype, validate_optim_config
from optim_factory.optimizers import te_fused_adam
from recipes.config import GROUP_SCHEMAS, ModelConfig, TrainConfig
from recipes.model import DecoderLM
from recipes.train import compose_config

CONF = Path(__file__).resolve().parents[2] / "conf"


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return DecoderLM(ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8))


def all_config_choices() -> list[list[str]]:
    """One override list per YAML file in conf/ (each group option, each experiment)."""
    choices = []
    for path in sorted(CONF.rglob("*.yaml")):
        rel = path.relative_to(CONF)
        if rel.parts == ("train.yaml",):
            choices.append([])
        elif rel.parts[0] in ("optim", "model", "data", "checkpoint", "trainer", "experiment"):
            group = "/".join(rel.parts[:-1])
            extra = ["data.path=/tmp/unused.bin"] if rel.stem == "tokens" else []
            choices.append([f"{group}={rel.stem}", *extra])
        elif rel.parts[0] == "hydra":
            choices.append([f"{'/'.join(rel.parts[:-1])}={rel.stem}"])
    return choices


@pytest.mark.parametrize("overrides", all_config_choices(), ids=lambda o: ",".join(o) or "train.yaml")
def test_every_yaml_composes_and_builds_an_optimizer(overrides, tmp_path):
    if overrides and overrides[0].startswith("hydra/"):
        pytest.skip("launcher configs are composed by their own tests")
    cfg = compose_config([*overrides, f"run_dir={tmp_path}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = build_optimizer(cfg.optim, tiny_model())
    assert isinstance(opt, (PortableFusedAdam, torch.optim.AdamW))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(tiny_model().parameters()))


def test_every_yaml_file_is_covered():
    files = {p.relative_to(CONF).as_posix() for p in CONF.rglob("*.yaml")}
    covered = {"train.yaml"} | {f"{o[0].split('=')[0]}/{o[0].split('=')[1]}.yaml" for o in all_config_choices() if o}
    assert files == covered


OPTION_OVERRIDES = [
    ("state_dict_cpu_offload=true", "state_dict_cpu_offload", True),
    ("exp_avg_dtype=bf16", "exp_avg_dtype", torch.bfloat16),
    ("exp_avg_dtype=fp16", "exp_avg_dtype", torch.float16),
    ("exp_avg_dtype=fp8", "exp_avg_dtype", torch.uint8),
    ("exp_avg_sq_dtype=bf16", "exp_avg_sq_dtype", torch.bfloat16),
    ("exp_avg_sq_dtype=fp16", "exp_avg_sq_dtype", torch.float16),
    ("exp_avg_sq_dtype=fp8", "exp_avg_sq_dtype", torch.uint8),
    ("master_weights=true", "master_weights", True),
    ("master_weight_dtype=fp16", "master_weight_dtype", torch.float16),
    ("capturable=true", "capturable", True),
    ("use_decoupled_grad=true", "use_decoupled_grad", True),
    ("adam_w_mode=false", "adam_w_mode", 0),
]


@pytest.mark.parametrize("override,attr,expected", OPTION_OVERRIDES, ids=[o[0] for o in OPTION_OVERRIDES])
def test_each_fused_adam_option_reaches_the_optimizer(override, attr, expected, tmp_path):
    cfg = compose_config([f"optim.{override}", f"run_dir={tmp_path}"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = build_optimizer(cfg.optim, tiny_model())
    assert isinstance(opt, PortableFusedAdam)
    assert getattr(opt, attr) == expected


def test_remainders_betas_eps_weight_decay_lr_reach_the_optimizer(tmp_path):
    cfg = compose_config(
        [
            "optim.master_weights=true",
            "optim.store_param_remainders=true",
            "optim.betas=[0.8,0.9]",
            "optim.eps=1e-6",
            "optim.weight_decay=0.2",
            "optim.lr=0.01",
            "optim.bias_correction=false",
            "model.dtype=bf16",
            f"run_dir={tmp_path}",
        ]
    )
    model = tiny_model().bfloat16()
    opt = build_optimizer(cfg.optim, model)
    assert opt.store_param_remainders is True
    for g in opt.param_groups:
        assert g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 and g["lr"] == 0.01 and g["bias_correction"] is False
    assert {g["weight_decay"] for g in opt.param_groups} == {0.2, 0.0}


def test_each_adamw_option_reaches_torch_s_adamw(tmp_path):
    """optim=adamw builds torch's AdamW with every option its config sets (amsgrad included)."""
    overrides = ["amsgrad=true", "foreach=false", "betas=[0.8,0.9]", "eps=1e-6", "weight_decay=0.2", "lr=0.01"]
    cfg = compose_config(["optim=adamw", *(f"optim.{o}" for o in overrides), f"run_dir={tmp_path}"])
    opt = build_optimizer(cfg.optim, tiny_model())
    assert type(opt) is torch.optim.AdamW
    for g in opt.param_groups:
        assert g["amsgrad"] is True and g["foreach"] is False, g
        assert g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 and g["lr"] == 0.01
    assert {g["weight_decay"] for g in opt.param_groups} == {0.2, 0.0}


def test_the_lowmem_preset_keeps_int16_remainders_and_bf16_moments(tmp_path):
    """experiment=lowmem, the recommended low-memory setting, as the recipe builds it: BF16 parameters whose FP32
    master is kept as int16 remainders (no full master) and BF16 moments, 6 bytes of state per parameter."""
    from recipes.model import build_model

    cfg = compose_config(["experiment=lowmem", f"run_dir={tmp_path}", "model.d_model=16", "model.n_layers=1"])
    model = build_model(cfg.model, seed=0, device=torch.device("cpu"))
    opt = build_optimizer(cfg.optim, model)
    opt.initialize_states()
    want = {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16, "master_param": torch.int16}
    for name, p in model.named_parameters():
        state = {k: v.dtype for k, v in opt.state[p].items()}
        assert p.dtype == torch.bfloat16 and state == want, (name, p.dtype, state)


def test_cfg_as_dataclass_dict_and_named_parameters():
    model = tiny_model()
    a = build_optimizer(FusedAdamConfig(lr=0.02, exp_avg_dtype="bf16"), model)
    b = build_optimizer({"lr": 0.02, "exp_avg_dtype": "torch.bfloat16"}, list(model.named_parameters()))
    c = build_optimizer(AdamWConfig(lr=0.02), model)
    assert a.exp_avg_dtype == b.exp_avg_dtype == torch.bfloat16
    assert isinstance(c, torch.optim.AdamW) and c.param_groups[0]["lr"] == 0.02


def test_backend_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="optim_factory.factory"):
        build_optimizer({"backend": "auto"}, tiny_model())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer:")]
    assert len(lines) == 1 and "PortableFusedAdam" in lines[0] and "auto:" in lines[0]
    assert sum(r.getMessage().startswith("param group") for r in caplog.records) == 2


@pytest.mark.parametrize(
    "cfg,line",
    [
        ({}, "master none, exp_avg fp32, exp_avg_sq fp32; state_dict: on the device, FP32"),
        (
            {"exp_avg_dtype": "bf16", "state_dict_cpu_offload": True},
            "master none, exp_avg bf16, exp_avg_sq fp32; state_dict: to CPU in chunks of 64MiB, fresh host memory",
        ),
        (
            {"state_dict_cpu_offload": True, "state_dict_offload_chunk_bytes": 0},
            "master none, exp_avg fp32, exp_avg_sq fp32; state_dict: to CPU, one state at a time",
        ),
        (
            {
                "master_weights": True,
                "store_param_remainders": True,
                "exp_avg_sq_dtype": "fp8",
                "state_dict_cpu_offload": True,
                "state_dict_offload_chunk_bytes": "64MiB",
                "state_dict_offload_reuse_buffers": True,
                "state_dict_keep_bf16": True,
                "state_dict_offload_background": True,
            },
            "master fp32, exp_avg fp32, exp_avg_sq fp8; state_dict: to CPU in chunks of 64MiB, reused "
            "host buffers (pinning register), BF16 kept, in the background",
        ),
        (
            {"master_weights": True, "state_dict_cpu_offload": True, "state_dict_offload_chunk_bytes": 1 << 20},
            "master fp32, exp_avg fp32, exp_avg_sq fp32; state_dict: to CPU in chunks of 1MiB, fresh host memory",
        ),
    ],
    ids=["default", "offload-bf16", "per-state", "everything-fp32-params", "chunked"],
)
def test_the_states_and_the_export_in_effect_are_logged(cfg, line, caplog):
    """What the built optimizer keeps and exports, from what it was built with: one line says which moments (e.g.
    BF16) and which export (e.g. the offload) are in effect."""
    with caplog.at_level(logging.INFO, logger="optim_factory.factory"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no GPU here: the offload warns that it saves no memory
        build_optimizer(cfg, tiny_model())
        if cfg.get("store_param_remainders"):  # the same with BF16 parameters: remainders
            build_optimizer(cfg, tiny_model().to(torch.bfloat16))
            said = [r.getMessage() for r in caplog.records]
            assert any(m.startswith("optimizer states: master int16 remainders (BF16 parameters),") for m in said)
    assert f"optimizer states: {line}" in [r.getMessage() for r in caplog.records]


@pytest.mark.skipif(te_fused_adam.TE_AVAILABLE, reason="checks the message without Transformer Engine")
def test_backend_te_without_te_names_the_fix():
    with pytest.raises(ConfigError) as info:
        build_optimizer({"backend": "te"}, tiny_model())
    msg = str(info.value)
    assert msg.startswith("optim.backend='te':") and "pip install" in msg and "backend=portable" in msg


def test_warnings_for_options_without_effect(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU the model is not on
    with pytest.warns(UserWarning, match="state_dict_cpu_offload=True has no memory effect"):
        build_optimizer({"state_dict_cpu_offload": True}, tiny_model())
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="no parameter is BF16"):
        build_optimizer({"master_weights": True, "store_param_remainders": True}, tiny_model())
    with pytest.warns(UserWarning, match="master_weights=true has no effect: no parameter is BF16 or FP16"):
        build_optimizer({"master_weights": True}, tiny_model())  # FP32 parameters
    with pytest.warns(UserWarning, match="no effect without master_weights"):
        validate_optim_config({"store_param_remainders": True})
    keep = r"state_dict_keep_bf16=True has no effect: no optimizer state is BF16 \(exp_avg_dtype=fp32, "
    with pytest.warns(UserWarning, match=keep):
        validate_optim_config({"state_dict_keep_bf16": True})  # FP32 moments: nothing to keep
    with pytest.warns(UserWarning, match="master_weight_dtype=fp16 has no effect without master_weights=True"):
        validate_optim_config({"master_weight_dtype": "fp16"})
    # the constructors' own rules (one source): also without the factory
    with pytest.warns(UserWarning, match=keep):
        PortableFusedAdam(tiny_model().parameters(), state_dict_keep_bf16=True)
    with pytest.warns(UserWarning, match="master_weight_dtype=fp16 has no effect without master_weights=True"):
        PortableFusedAdam(tiny_model().parameters(), master_weight_dtype="fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # where they take effect: no warning
        validate_optim_config({"state_dict_keep_bf16": True, "exp_avg_dtype": "bf16"})
        validate_optim_config({"master_weight_dtype": "fp16", "master_weights": True})


# --------------------------------------------------------------------------------------------- malformed
MALFORMED = [
    ({"no_such_key": 1}, "no_such_key"),
    ({"lr": "fast"}, "lr"),
    ({"lr": -1.0}, "optim.lr=-1.0"),
    ({"lr": 0.0}, "optim.lr=0.0"),
    ({"lr": float("nan")}, "optim.lr=nan"),
    ({"lr": float("inf")}, "optim.lr=inf"),
    ({"betas": [0.9]}, "optim.betas=[0.9]"),
    ({"betas": [0.9, 0.999, 0.5]}, "optim.betas="),
    ({"betas": [1.0, 0.999]}, "optim.betas[0]=1.0"),
    ({"betas": [0.9, -0.1]}, "optim.betas[1]=-0.1"),
    ({"betas": "high"}, "betas"),
    ({"eps": -1e-8}, "optim.eps=-1e-08"),
    ({"weight_decay": -0.1}, "optim.weight_decay=-0.1"),
    ({"exp_avg_dtype": "fp64"}, "optim.exp_avg_dtype='fp64'"),
    ({"exp_avg_dtype": "int8"}, "optim.exp_avg_dtype='int8'"),
    ({"exp_avg_sq_dtype": "torch.float64"}, "optim.exp_avg_sq_dtype='torch.float64'"),
    ({"master_weight_dtype": "bf16"}, "optim.master_weight_dtype='bf16'"),
    ({"master_weight_dtype": "fp8"}, "optim.master_weight_dtype='fp8'"),
    ({"backend": "cuda"}, "optim.backend='cuda'"),
    ({"name": "sgd"}, "optim.name='sgd'"),
    ({"amsgrad": True}, "optim.amsgrad=True"),
    ({"capturable": True, "exp_avg_dtype": "fp16", "exp_avg_sq_dtype": "fp16"}, "optim.exp_avg_dtype='fp16/fp16'"),
    ({"capturable": True, "exp_avg_dtype": "bf16"}, "optim.exp_avg_dtype='bf16/fp32'"),
    ({"capturable": True, "master_weights": True, "master_weight_dtype": "fp16"}, "optim.master_weight_dtype='fp16'"),
    ({"capturable": True, "master_weights": True, "store_param_remainders": True}, "optim.store_param_remainders=True"),
    ({"capturable": "maybe"}, "capturable"),
    ({"state_dict_cpu_offload": "sometimes"}, "state_dict_cpu_offload"),
    ({"state_dict_cpu_offload": True, "state_dict_offload_chunk_bytes": "64 MB"}, "chunk_bytes='64 MB'"),
    ({"state_dict_cpu_offload": True, "state_dict_offload_chunk_bytes": 8}, "optim.state_dict_offload_chunk_bytes=8: "),
    ({"state_dict_offload_chunk_bytes": "64MiB"}, "needs optim.state_dict_cpu_offload=true"),
    (
        {"state_dict_offload_reuse_buffers": True},
        "optim.state_dict_offload_reuse_buffers=True: needs optim.state_dict_cpu",
    ),
    (
        {"state_dict_cpu_offload": True, "state_dict_offload_chunk_bytes": 0, "state_dict_offload_background": True},
        "optim.state_dict_offload_background=True: needs optim.state_dict_offload_chunk_bytes != 0",
    ),
    ({"param_groups": {"no_decay": ["("]}}, "optim.param_groups.no_decay[0]='('"),
    ({"param_groups": {"no_decay": [""]}}, "optim.param_groups.no_decay[0]=''"),
    (
        {"param_groups": {"overrides": [{"pattern": "no_such_param", "lr_mult": 2.0}]}},
        "optim.param_groups.overrides[0].pattern='no_such_param': matches no trainable parameter",
    ),
    (
        {"param_groups": {"overrides": [{"pattern": "blocks", "lr_mult": 0.0}]}},
        "optim.param_groups.overrides[0].lr_mult=0.0",
    ),
    (
        {"param_groups": {"overrides": [{"pattern": "blocks", "weight_decay_mult": -1.0}]}},
        "optim.param_groups.overrides[0].weight_decay_mult=-1.0",
    ),
    ({"param_groups": {"overrides": [{"pattern": "blocks"}, {"pattern": "qkv"}]}}, "patterns overlap on parameter"),
    ({"param_groups": {"overrides": [{"pattern": "[a-"}]}}, "optim.param_groups.overrides[0].pattern='[a-'"),
    # the full dotted key, not the leaf only (optim.lr_mul) nor optim.?=None; ??? is refused, not the default
    (
        {"param_groups": {"overrides": [{"pattern": "blocks", "lr_mul": 2}]}},
        "overrides[0].lr_mul: not a config key; did you mean optim.param_groups.overrides[0].lr_mult?",
    ),
    ({"param_groups": {"overrides": {"pattern": "blocks"}}}, "optim.param_groups.overrides={'pattern': 'blocks'}: "),
    ({"lr": "???"}, "optim.lr: missing value (???: mandatory, never given; set optim.lr=...)"),
    ({"param_groups": {"overrides": ["abc"]}}, "optim.param_groups.overrides[0]='abc': expected a mapping"),
    ({"param_groups": {"no_decay": ["bias", "???"]}}, "optim.param_groups.no_decay[1]: missing value"),
    ({"param_groups": {"unknown": 1}}, "unknown"),
    ({"name": "adamw", "exp_avg_dtype": "bf16"}, "exp_avg_dtype"),
    ({"name": "adamw", "lr": -3.0}, "optim.lr=-3.0"),
]


@pytest.mark.parametrize("cfg,fragment", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_config_raises_one_clear_line(cfg, fragment):
    with pytest.raises(ConfigError) as info:
        build_optimizer(cfg, tiny_model())
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert msg.startswith("optim.") or msg.startswith("build_optimizer"), msg
    assert fragment in msg, msg


def test_at_least_thirty_malformed_cases():
    assert len(MALFORMED) >= 30


def test_the_public_functions_that_read_the_config_refuse_as_its_keys(monkeypatch):
    """choose_backend and build_param_groups, called directly, refuse in the config's line, as build_optimizer does."""
    from optim_factory.factory import build_param_groups, choose_backend

    monkeypatch.setattr(te_fused_adam, "TE_AVAILABLE", True)
    with pytest.raises(ConfigError, match=r"^optim\.backend='te': TE's FusedAdam needs CUDA parameters"):
        choose_backend("te", [torch.zeros(2)])
    model = tiny_model()
    config = validate_optim_config({"param_groups": {"overrides": [{"pattern": "no_such_param"}]}}).config
    with pytest.raises(ConfigError) as info:
        build_param_groups(config, list(model.named_parameters()), model)
    assert str(info.value) == "optim.param_groups.overrides[0].pattern='no_such_param': matches no trainable parameter"


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("optim.no_such_key=1", "optim.no_such_key: not a config key"),
        ("optim.lr=fast", "optim.lr='fast'"),
        ("optim.capturable=maybe", "optim.capturable='maybe'"),
        ("optim.param_groups.bogus=1", "optim.param_groups.bogus: not a config key"),
        ("optim.betas=oops", "optim.betas='oops'"),
        ("optim.exp_avg_dtype=fp64", "optim.exp_avg_dtype='fp64': expected one of fp32|fp16|bf16|fp8"),
        ("optim.master_weight_dtype=float32", "optim.master_weight_dtype='float32': expected one of fp32|"),
        ("optim.backend=cuda", "optim.backend='cuda': expected one of auto|te|portable"),
        ("model.dtype=fp16", "model.dtype='fp16': expected one of fp32|bf16"),
        ("trainer.device=tpu", "trainer.device='tpu': expected one of auto|cpu|cuda"),
        ("data.kind=text", "data.kind='text': expected one of addition|tokens"),
    ],
)
def test_unknown_keys_wrong_types_and_choices_fail_at_compose_time(override, fragment, tmp_path):
    with pytest.raises(ConfigError) as info:
        compose_config([override, f"run_dir={tmp_path}"])
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_python_configs_take_dtypes_as_the_constructors_do():
    for spelled in (torch.float16, "torch.float16", "float16", "half", "fp16"):
        assert validate_optim_config({"exp_avg_dtype": spelled}).config.exp_avg_dtype == StateDtype.fp16
    assert validate_optim_config({"exp_avg_sq_dtype": torch.float8_e4m3fn}).kwargs["exp_avg_sq_dtype"] == torch.uint8


def test_parse_dtype_spellings():
    assert parse_dtype("fp8") == parse_dtype("torch.uint8") == parse_dtype(torch.float8_e4m3fn) == torch.uint8
    assert parse_dtype("BF16") == parse_dtype(torch.bfloat16) == torch.bfloat16
    assert parse_dtype(" float32 ") == torch.float32


# ------------------------------------------------------------------------------------------ parameter groups
def test_default_groups_no_decay_for_bias_norm_embedding():
    model = tiny_model()
    opt = build_optimizer({"weight_decay": 0.1}, model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    decay = {name_of[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {name_of[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert all(n.endswith(".bias") or "norm" in n or "embed" in n for n in no_decay)
    assert {"embed.weight", "pos_embed.weight", "norm.weight", "norm.bias", "blocks.0.qkv.bias"} <= no_decay
    assert decay == {
        "blocks.0.qkv.weight",
        "blocks.0.proj.weight",
        "blocks.0.fc.weight",
        "blocks.0.out.weight",
        "lm_head.weight",
    }
    every = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(every) == sorted(id(p) for p in model.parameters()) and len(set(every)) == len(every)


def test_overrides_multiply_lr_and_weight_decay():
    pg = ParamGroupsConfig(overrides=[GroupOverride(pattern=r"^lm_head", lr_mult=0.5, weight_decay_mult=2.0)])
    opt = build_optimizer(FusedAdamConfig(lr=0.01, weight_decay=0.1, param_groups=pg), tiny_model())
    head = [
        g for g in opt.param_groups if len(g["params"]) == 1 and g["params"][0].shape == (16, 16) and g["lr"] == 0.005
    ]
    assert head and head[0]["weight_decay"] == pytest.approx(0.2)


def test_custom_no_decay_and_unused_default_pattern_is_reported(caplog):
    with caplog.at_level(logging.INFO, logger="optim_factory.factory"):
        opt = build_optimizer(
            {"param_groups": {"no_decay": ["bias$", "never_matches"], "no_decay_auto": False}, "weight_decay": 0.1},
            tiny_model(),
        )
    assert any("never_matches" in r.getMessage() and "matches no parameter" in r.getMessage() for r in caplog.records)
    assert sum(len(g["params"]) for g in opt.param_groups if g["weight_decay"] == 0) == 7  # the biases


def test_frozen_parameters_are_left_out():
    model = tiny_model()
    model.embed.weight.requires_grad_(False)
    opt = build_optimizer({}, model)
    assert all(p is not model.embed.weight for g in opt.param_groups for p in g["params"])


def test_yaml_node_is_accepted_directly():
    node = OmegaConf.load(CONF / "optim" / "fused_adam.yaml")
    node.pop("defaults")
    opt = build_optimizer(node, tiny_model())
    assert isinstance(opt, PortableFusedAdam) and opt.param_groups[0]["lr"] == node.lr


# ---------------------------------------------------------------------------------------- one source of defaults
def _schema_defaults(schema: type) -> dict:
    return {f.name: getattr(schema(), f.name) for f in dataclasses.fields(schema)}


def _assert_constructor_defaults_equal_schema(fn, schema: type) -> int:
    params = inspect.signature(fn).parameters
    schema_defaults = _schema_defaults(schema)
    overlap = [k for k in schema_defaults if k in params and params[k].default is not inspect.Parameter.empty]
    for key in overlap:
        ours, theirs = schema_defaults[key], params[key].default
        if isinstance(ours, StateDtype):
            ours = parse_dtype(ours)  # dtypes compare after parsing
        if isinstance(theirs, tuple):
            ours = tuple(ours)
        assert ours == theirs, f"{schema.__name__}.{key}={ours!r} but {fn.__qualname__} defaults to {theirs!r}"
    return len(overlap)


def test_schema_defaults_are_the_portable_constructors():
    assert _assert_constructor_defaults_equal_schema(PortableFusedAdam.__init__, FusedAdamConfig) >= 17


def test_adamw_schema_defaults_are_torch_adamws():
    assert _assert_constructor_defaults_equal_schema(torch.optim.AdamW.__init__, AdamWConfig) == 6


def test_schema_defaults_are_te_fused_adams():
    te = pytest.importorskip("transformer_engine.pytorch.optimizers", reason="Transformer Engine not installed")
    assert _assert_constructor_defaults_equal_schema(te.FusedAdam.__init__, FusedAdamConfig) >= 14


def test_build_optimizer_on_an_empty_config_is_the_constructors_default():
    model = tiny_model()
    ours = build_optimizer({"param_groups": {"no_decay": []}}, model)
    theirs = PortableFusedAdam(model.parameters())
    assert ours.param_groups[0].keys() == theirs.param_groups[0].keys()
    for key in theirs.param_groups[0]:
        if key != "params":
            assert ours.param_groups[0][key] == theirs.param_groups[0][key], key
    assert ours.defaults == theirs.defaults


# A discriminator names the schema a file is for, so that the file read on its own (OmegaConf.load, then
# build_optimizer) builds the right thing; it may equal the schema's default.
DISCRIMINATORS = {"optim": {"name"}, "data": {"kind"}}


def _leaves(node, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if key == "defaults":
            continue
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_leaves(value, path + "."))
        else:
            out[path] = value
    return out


def _baseline(group: str, raw: dict):
    """What a group file's keys would be without them: its schema's defaults and the files it builds on."""
    schema = {"optim": None, **GROUP_SCHEMAS}[group]
    if group == "optim":
        from optim_factory.config import OPTIM_SCHEMAS

        schema = OPTIM_SCHEMAS[raw.get("name", "fused_adam")]
    base = OmegaConf.structured(schema)
    for parent in raw.get("defaults", []):
        if isinstance(parent, str) and parent != "_self_" and not parent.startswith("/"):  # /<schema>@_here_
            body = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{parent}.yaml"))
            body.pop("defaults", None)
            base = OmegaConf.merge(base, body)
    return base


def yaml_bodies():
    for path in sorted(CONF.rglob("*.yaml")):
        rel = path.relative_to(CONF)
        if rel.parts[0] != "hydra":  # launcher files configure the submitit plugin's schema, not ours
            yield pytest.param(rel, id=rel.as_posix())


@pytest.mark.parametrize("rel", list(yaml_bodies()))
def test_yaml_files_hold_only_what_differs_from_the_schema(rel):
    raw = OmegaConf.to_container(OmegaConf.load(CONF / rel))
    group = rel.parts[0] if len(rel.parts) > 1 else None
    if group == "experiment":  # @package _global_: compared with the composed default config
        base = compose_config([])
    elif group is None:  # train.yaml: the root schema; Hydra's own settings are not ours
        raw.pop("hydra", None)
        base = OmegaConf.structured(TrainConfig)
    else:
        base = _baseline(group, raw)
    leaves = _leaves(raw)
    repeated = [
        f"{key}={value!r}"
        for key, value in leaves.items()
        if key not in DISCRIMINATORS.get(group, ()) and OmegaConf.select(base, key) == value
    ]
    assert not repeated, f"{rel} repeats what it would be without these keys: {repeated}"
    for key in leaves:  # and every key exists in the schema (a typo would otherwise be a silent no-op)
        assert OmegaConf.select(base, key, default="<absent>") != "<absent>", f"{rel}: {key} is not a schema key"


def test_recipe_yaml_sets_what_the_readme_documents():
    cfg = compose_config([])
    assert cfg.optim.lr == 5e-3 and list(cfg.optim.betas) == [0.9, 0.95] and cfg.optim.weight_decay == 0.1
    assert cfg.checkpoint.every_steps == 250 and cfg.data.seq_len == 24 and cfg.trainer.warmup_steps == 30


# ------------------------------------------------------------------------------------ validation: pure, once
def test_validate_optim_config_is_pure_and_its_result_read_only():
    cfg = {"state_dict_cpu_offload": True, "state_dict_offload_chunk_bytes": "64MiB", "exp_avg_dtype": "bf16"}
    node = OmegaConf.create(copy.deepcopy(cfg))
    before = copy.deepcopy(cfg)
    a, b = validate_optim_config(cfg), validate_optim_config(node)
    assert cfg == before and OmegaConf.to_container(node) == before
    assert isinstance(a, ValidatedOptim) and dict(a.kwargs) == dict(b.kwargs)
    assert a.config.state_dict_offload_chunk_bytes == "64MiB"  # as given; the bytes are in kwargs
    assert a.kwargs["state_dict_offload_chunk_bytes"] == 64 << 20 and a.kwargs["exp_avg_dtype"] == torch.bfloat16
    with pytest.raises(ReadonlyConfigError):
        a.config.lr = 1.0
    with pytest.raises(TypeError):
        a.kwargs["lr"] = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.config = None
    again = validate_optim_config(a.config)  # the result is a valid input too, and validates to the same
    assert dict(again.kwargs) == dict(a.kwargs)


def test_build_optimizer_takes_a_validated_config_without_validating_again():
    v = validate_optim_config({"lr": 0.02, "state_dict_cpu_offload": True, "state_dict_offload_chunk_bytes": "1KiB"})
    # kwargs that validating v.config again would not give: build_optimizer must use them as they are
    taken = ValidatedOptim(v.config, MappingProxyType({**v.kwargs, "eps": 0.5}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload on CPU
        opt = build_optimizer(taken, tiny_model())
    assert isinstance(opt, PortableFusedAdam) and opt.defaults["eps"] == 0.5 and opt.param_groups[0]["lr"] == 0.02
    assert opt.state_dict_offload_chunk_bytes == 1024


def test_unknown_key_added_to_a_typed_node_is_refused_with_the_nearest_key():
    node = OmegaConf.structured(FusedAdamConfig)
    with open_dict(node):  # what Hydra's +optim.state_dict_cpu_ofload=true does
        node.state_dict_cpu_ofload = True
    with pytest.raises(ConfigError) as info:
        validate_optim_config(node)
    assert str(info.value) == (
        "optim.state_dict_cpu_ofload: not a config key; did you mean optim.state_dict_cpu_offload?"
    )
