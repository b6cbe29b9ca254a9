"""Resume is explicit (issue 15, item 3; observations 4 and 6): every config change across a resume takes effect
(hyperparameters), converts exactly (state layout) or is refused in one line (recipes/checkpoint/resume.py's table).

The layout tests compare the loaded optimizer states with the checkpoint's values (read back with
``read_checkpoint``), converted as the new config stores them.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from optim_factory import ConfigError, build_optimizer
from optim_factory.optimizers.export import join_bf16_remainder, local_tensor, split_bf16_remainder
from recipes.checkpoint import CheckpointError, CheckpointManager, read_checkpoint
from recipes.checkpoint.checksums import MANIFEST_DIGEST
from recipes.checkpoint.load import HYPERPARAMETERS
from recipes.checkpoint.resume import (
    CONVERTED,
    IGNORED,
    RESUME_RULES,
    T_HYPER_LOG,
    ResumeRefused,
    compare,
    log_changes,
    markdown_table,
    moot,
    rule_for,
)
from recipes.command_line import keys_set
from recipes.distributed import DistEnv, init_distributed, shutdown
from recipes.job import shard_model, train
from recipes.model import build_model
from recipes.train import CONFIG_DIR, compose_config
from tests.recipe.runs import QUICK, ROOT, cli, metrics, snapshot

STEP10 = "step_00000010"


@pytest.fixture(scope="module")
def save(tmp_path_factory):
    """``save(run_dir, *overrides)``: ``run_dir`` holds the quick job with ``overrides`` stopped at step 10 (one
    checkpoint); returns the checkpoint's contents. Each config trains once per module, later calls copy it."""
    runs: dict[tuple[str, ...], Path] = {}

    def save(run_dir: Path, *overrides: str) -> dict:
        if overrides not in runs:
            runs[overrides] = tmp_path_factory.mktemp("saved") / "run"
            train(compose_config([*QUICK, f"run_dir={runs[overrides]}", "trainer.stop_at=10", *overrides]))
        shutil.copytree(runs[overrides], run_dir, dirs_exist_ok=True)
        return read_checkpoint(run_dir / "checkpoints" / STEP10)

    return save


@pytest.fixture
def resume_live():
    """``resume_live(run_dir, *overrides)``: the recipe's model + optimizer for the config, resumed from
    ``run_dir`` by a manager that knows the run's config (as ``train`` builds them); one gloo process."""

    def build(run_dir: Path, *overrides: str):
        cfg = compose_config([*QUICK, f"run_dir={run_dir}", *overrides])
        mesh = init_distributed(DistEnv(0, 1, 0, "127.0.0.1", 0, "single"), torch.device("cpu"))
        model = shard_model(build_model(cfg.model, seed=cfg.trainer.seed, device=torch.device("cpu")), mesh)
        opt = build_optimizer(cfg.optim, model)
        ckpt = CheckpointManager(
            cfg.checkpoint, rank=0, device=torch.device("cpu"), run_config=OmegaConf.to_container(cfg, resolve=True)
        )
        template = {"step": 0, "data_position": 0, "world_size": 0, "rng_state": torch.get_rng_state()}
        path, state = ckpt.resume(model, opt, template)
        assert path.name == STEP10 and state["step"] == 10
        return cfg, model, opt, ckpt

    yield build
    shutdown()


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------- converts
BF16 = ["model.dtype=bf16"]
MASTER = [*BF16, "optim.master_weights=true"]
REMAINDERS = [*MASTER, "optim.store_param_remainders=true"]


def _moment_expected(saved: torch.Tensor, dtype: str) -> torch.Tensor:
    return saved.float().to(torch.bfloat16).float() if dtype == "bf16" else saved.float()


# (saved overrides, resumed overrides, the changed keys, moments dtype after resume, master check)
# master check: "saved" (the saved FP32 master), "join" (the saved remainders joined with the saved parameter),
# "param" (the saved parameter, widened: master turned on), "none" (master turned off), "fp16" (the saved master
# in an FP16 master with a fresh scale), None (FP32 parameters: no master)
LAYOUT = [
    (
        [],
        ["optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"],
        ["exp_avg_dtype", "exp_avg_sq_dtype"],
        "bf16",
        None,
    ),
    (
        ["optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"],
        [],
        ["exp_avg_dtype", "exp_avg_sq_dtype"],
        "fp32",
        None,
    ),
    (
        ["optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16", "optim.state_dict_keep_bf16=true"],
        [],
        ["exp_avg_dtype", "exp_avg_sq_dtype", "state_dict_keep_bf16"],
        "fp32",
        None,
    ),
    (
        [],
        ["optim.exp_avg_dtype=fp16", "optim.exp_avg_sq_dtype=fp8"],
        ["exp_avg_dtype", "exp_avg_sq_dtype"],
        "scaled",
        None,
    ),
    (["optim.state_dict_cpu_offload=true"], [], ["state_dict_cpu_offload"], "fp32", None),
    (MASTER, REMAINDERS, ["store_param_remainders"], "fp32", "saved"),
    (REMAINDERS, MASTER, ["store_param_remainders"], "fp32", "join"),
    (BF16, MASTER, ["master_weights"], "fp32", "param"),
    (BF16, REMAINDERS, ["master_weights", "store_param_remainders"], "fp32", "param"),
    (MASTER, BF16, ["master_weights"], "fp32", "none"),
    (MASTER, [*MASTER, "optim.master_weight_dtype=fp16"], ["master_weight_dtype"], "fp32", "fp16"),
]

# Measured (this CPU, torch 2.13, the quick job's step-10 states), max |loaded - saved| over each tensor's largest
# magnitude: FP16 moments 2.44e-4, FP8 (E4M3) second moments 3.56e-2, FP16 master 2.44e-4 (fresh per-tensor
# scales). Bounds: twice the measurement.
SCALED_RTOL = {"exp_avg": 5e-4, "exp_avg_sq": 7.5e-2, "master_param": 5e-4}


def _close(loaded: torch.Tensor, expected: torch.Tensor, name: str) -> bool:
    scale = expected.abs().max().clamp_min(1e-30)
    return bool(((loaded - expected).abs().max() / scale) <= SCALED_RTOL[name])


@pytest.mark.parametrize(
    "saved_cfg,resumed_cfg,keys,moments,master",
    LAYOUT,
    ids=[f"{'+'.join(a) or 'default'}->{'+'.join(b) or 'default'}" for a, b, *_ in LAYOUT],
)
def test_layout_converts(save, saved_cfg, resumed_cfg, keys, moments, master, tmp_path, resume_live):
    saved = save(tmp_path, *saved_cfg)
    cfg, model, opt, ckpt = resume_live(tmp_path, *resumed_cfg)
    assert {c.key: c.action for c in ckpt.loader.resume_changes} == {f"optim.{k}": CONVERTED for k in keys}
    for fqn, p in _params(model).items():
        live = local_tensor(p).detach()
        expected_param = saved[f"model.{fqn}"]
        saved_master = saved.get(f"optim.state.{fqn}.master_param")
        if master == "saved" and saved_master is not None and saved_master.dtype == torch.float32:
            # FP32 master -> int16 remainders: the parameter becomes the master rounded as the remainder kernels
            # round (differs from the saved BF16 parameter only where the master lies exactly between two BF16s)
            expected_param = torch.empty_like(expected_param)
            split_bf16_remainder(saved_master, expected_param, torch.empty_like(live, dtype=torch.int16))
        assert _same(live, expected_param), f"{fqn}: parameter differs from the checkpoint's"
        st = opt.state[p]
        for name in ("exp_avg", "exp_avg_sq"):
            loaded, ref = opt.get_unscaled_state(p, name), saved[f"optim.state.{fqn}.{name}"]
            if moments == "scaled":
                assert _close(loaded, ref.float(), name), f"{fqn}.{name}"
            else:
                assert _same(loaded, _moment_expected(ref, moments)), f"{fqn}.{name}: not the checkpoint's value"
        key = f"optim.state.{fqn}.master_param"
        if master is None or p.dtype == torch.float32:
            assert "master_param" not in st or master in (None, "none")
            continue
        if master == "none":
            assert "master_param" not in st, f"{fqn}: master kept after master_weights=false"
            continue
        got = st["master_param"]
        full = join_bf16_remainder(live, local_tensor(got)) if got.dtype == torch.int16 else None
        if master == "saved":
            assert got.dtype == torch.int16 and _same(full, saved[key]), f"{fqn}: remainders do not rejoin the master"
        elif master == "join":
            assert _same(local_tensor(got), join_bf16_remainder(saved[f"model.{fqn}"], saved[key])), fqn
        elif master == "param":
            assert key not in saved
            value = full if full is not None else local_tensor(got)
            assert _same(value, saved[f"model.{fqn}"].float()), f"{fqn}: master is not the saved parameter"
        else:  # fp16
            assert _close(opt.get_unscaled_state(p, "master_param"), saved[key], "master_param"), fqn


def test_lowmem_after_the_default_run_starts_masters_from_the_parameters(save, tmp_path, resume_live):
    """Observation 3's second half: the README's order (default job, then the low-memory preset) loads."""
    saved = save(tmp_path, *BF16)
    _, model, opt, ckpt = resume_live(tmp_path, *BF16, "optim=fused_adam_lowmem")
    assert "optim.master_weights" in {c.key for c in ckpt.loader.resume_changes}
    for fqn, p in _params(model).items():
        rem = local_tensor(opt.state[p]["master_param"])
        assert _same(join_bf16_remainder(local_tensor(p).detach(), rem), saved[f"model.{fqn}"].float())


# ---------------------------------------------------------------------------------------------------- refused
REFUSED = [
    (["optim=adamw"], "optim.name", "fused_adam", "adamw"),
    (["optim.capturable=true"], "optim.capturable", "False", "True"),
    (["model.d_model=32", "model.d_ff=64"], "model.d_model", "64", "32"),
    (["model.dtype=bf16"], "model.dtype", "fp32", "bf16"),
    (["model.tie_embeddings=true"], "model.tie_embeddings", "False", "True"),
    (["checkpoint.flatten_optimizer_state_dict=false"], "checkpoint.flatten_optimizer_state_dict", "True", "False"),
    (["trainer.seed=7"], "trainer.seed", "0", "7"),  # applied, it would change nothing (bitwise the same)
]


@pytest.mark.parametrize("overrides,key,old,new", REFUSED, ids=[r[1] for r in REFUSED])
def test_refused_changes(save, overrides, key, old, new, tmp_path):
    save(tmp_path)
    before = snapshot(tmp_path / "checkpoints")
    launches = sorted((tmp_path / "launches").iterdir())
    with pytest.raises(ResumeRefused) as info:
        train(compose_config([*QUICK, f"run_dir={tmp_path}", "checkpoint.fallback=true", *overrides]))
    text = str(info.value)
    assert "\n" not in text and f"{key} is {old} in the checkpoint and {new} in the config" in text, text
    assert "use a new run_dir" in text and STEP10 in text
    assert snapshot(tmp_path / "checkpoints") == before
    assert sorted((tmp_path / "launches").iterdir()) == launches  # the refused launch's record is removed
    assert (tmp_path / "train.log").read_text().splitlines()[-1].endswith(f"[ERROR] {text}")


def test_a_refusal_reads_nothing_into_the_model_and_never_falls_back(tmp_path):
    train(compose_config([*QUICK, f"run_dir={tmp_path}"]))  # checkpoints at steps 10 and 20
    cfg = compose_config([*QUICK, f"run_dir={tmp_path}", "checkpoint.fallback=true", "optim.capturable=true"])
    mesh = init_distributed(DistEnv(0, 1, 0, "127.0.0.1", 0, "single"), torch.device("cpu"))
    try:
        model = shard_model(build_model(cfg.model, seed=cfg.trainer.seed, device=torch.device("cpu")), mesh)
        opt = build_optimizer(cfg.optim, model)
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        ckpt = CheckpointManager(
            cfg.checkpoint, rank=0, device=torch.device("cpu"), run_config=OmegaConf.to_container(cfg, resolve=True)
        )
        with pytest.raises(ResumeRefused, match="step_00000020 cannot be resumed"):
            ckpt.resume(model, opt, {"step": 0})
        assert all(torch.equal(before[n], p.full_tensor()) for n, p in model.named_parameters())
        assert not opt.state and ckpt.saver.verified is None
    finally:
        shutdown()


def test_adamw_group_keys_follow_the_config_or_are_refused(save, tmp_path, resume_live):
    """With optim=adamw, foreach False -> True takes effect in every group (DCP's load puts the checkpoint's False
    back); amsgrad True -> False is refused (the first step would fail: KeyError: 'max_exp_avg_sq'). Broken on
    purpose (foreach not restored; no amsgrad row): both fail."""
    save(tmp_path, "optim=adamw", "optim.foreach=false")
    _, _, opt, ckpt = resume_live(tmp_path, "optim=adamw", "optim.foreach=true")
    assert [g["foreach"] for g in opt.param_groups] == [True] * len(opt.param_groups)
    changed = {c.key: (c.checkpoint, c.config, c.action) for c in ckpt.loader.resume_changes}
    assert changed["optim.foreach"] == (False, True, "config")
    shutdown()
    amsgrad = tmp_path / "amsgrad"
    save(amsgrad, "optim=adamw", "optim.amsgrad=true")
    with pytest.raises(ResumeRefused, match="optim.amsgrad is True in the checkpoint and False in the config"):
        train(compose_config([*QUICK, f"run_dir={amsgrad}", "optim=adamw", "optim.amsgrad=false"]))


# ---------------------------------------------------------------------------------------------------- config wins
HYPER = [
    "optim.weight_decay=0.05",
    "optim.betas=[0.5,0.6]",
    "optim.eps=1e-3",
    "optim.bias_correction=false",
    "optim.lr=1e-3",
    "optim.param_groups.overrides=[{pattern: lm_head, lr_mult: 0.5, weight_decay_mult: 2.0}]",
]


def _by_name(model, opt) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups for p in g["params"]}


def test_hyperparameters_follow_the_config(save, tmp_path, resume_live):
    """Observation 6: resumed with other hyperparameters, every group has the config's (DCP restores the
    checkpoint's); the moments are the checkpoint's."""
    saved = save(tmp_path)
    cfg, model, opt, ckpt = resume_live(tmp_path, *HYPER)
    rule = _by_name(model, build_optimizer(cfg.optim, model))  # the config's groups (fresh, nothing loaded)
    got = _by_name(model, opt)
    assert got["lm_head.weight"]["weight_decay"] == pytest.approx(0.1) and got["lm_head.weight"]["lr"] == 5e-4
    assert got["blocks.0.qkv.weight"]["weight_decay"] == pytest.approx(0.05)
    for name, g in got.items():
        keys = [k for k in HYPERPARAMETERS if k in rule[name]]  # FusedAdam's groups have no foreach
        assert {k: g[k] for k in keys} == {k: rule[name][k] for k in keys}, name
        assert tuple(g["betas"]) == (0.5, 0.6) and g["eps"] == 1e-3 and g["bias_correction"] is False, name
        assert g["step"] == 10, name  # the step count is the checkpoint's
        for s in ("exp_avg", "exp_avg_sq"):
            assert _same(opt.get_unscaled_state(_params(model)[name], s), saved[f"optim.state.{name}.{s}"]), name
    changed = {c.key: (c.checkpoint, c.config, c.action) for c in ckpt.loader.resume_changes}
    assert changed["optim.weight_decay"] == (0.1, 0.05, "config")
    assert changed["optim.betas"] == ([0.9, 0.95], [0.5, 0.6], "config")
    assert changed["optim.eps"] == (1e-8, 1e-3, "config")


def test_hyperparameter_changes_are_logged_and_recorded(save, tmp_path, caplog):
    save(tmp_path)
    with caplog.at_level(logging.INFO, logger="recipes.checkpoint.resume"):
        train(compose_config([*QUICK, f"run_dir={tmp_path}", "optim.weight_decay=0", "trainer.max_steps=12"]))
    lines = [r.getMessage() for r in caplog.records if r.name == "recipes.checkpoint.resume"]
    assert "resume: optim.weight_decay 0.1 -> 0.0 (from the config)" in lines, lines
    assert "resume: trainer.max_steps 20 -> 12 (from the config)" in lines, lines
    recs = [r for r in metrics(tmp_path) if r["kind"] == "resume"]
    assert {"kind": "resume", "key": "optim.weight_decay", "checkpoint": 0.1, "config": 0.0, "action": "config"} in recs


def test_an_override_the_resuming_command_leaves_off_is_a_warning_naming_both_values(tmp_path):
    """The command line of the first launch set optim.lr, BF16 moments and trainer.warmup_steps; the resuming one
    (main, as the shell runs it) sets the warmup again and leaves the others off: the config's lr is used and the
    moments are converted back to FP32, each said as a WARNING with both values; a key the command sets stays
    INFO."""
    first = ["optim.lr=0.001", "optim.exp_avg_dtype=bf16", "trainer.warmup_steps=3", "trainer.stop_at=10"]
    train(compose_config([*QUICK, f"run_dir={tmp_path}", *first]))
    proc = cli(*QUICK, f"run_dir={tmp_path}", "trainer.warmup_steps=4", "trainer.max_steps=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"\[recipes\.checkpoint\.resume\]\[(\w+)\] (.*)", proc.stderr)
    assert sorted(lines) == [
        ("INFO", "resume: trainer.max_steps 20 -> 12 (from the config)"),
        ("INFO", "resume: trainer.warmup_steps 3 -> 4 (from the config)"),
        (
            "WARNING",
            "resume: optim.exp_avg_dtype bf16 -> fp32 (converted): this launch does not set optim.exp_avg_dtype (add "
            "optim.exp_avg_dtype=bf16 to keep the checkpoint's)",
        ),
        (
            "WARNING",
            "resume: optim.lr 0.001 -> 0.005 (from the config): this launch does not set optim.lr (add optim.lr=0.001 "
            "to keep the checkpoint's)",
        ),
    ], proc.stderr[-3000:]


def test_a_change_that_has_no_effect_in_the_run_says_why_and_advises_nothing(caplog):
    """A lowmem checkpoint (BF16 parameters, an FP32 master as int16 remainders) resumed with master_weights=false
    and the preset left off: the remainders' change applies to no master, so its line says so at INFO, not a
    WARNING advising store_param_remainders=true; with a master kept, the same change is the usual WARNING.
    Broken on purpose (the no-effect reason ignored): the WARNING and its advice."""
    optim = {"master_weights": True, "master_weight_dtype": "fp32", "store_param_remainders": True}
    saved = {"model": {"dtype": "bf16"}, "optim": optim}
    run = {"model": {"dtype": "bf16"}, "optim": {**optim, "master_weights": False, "store_param_remainders": False}}
    with caplog.at_level(logging.INFO, logger="recipes.checkpoint.resume"):
        log_changes(compare(saved, run), typed=["optim.master_weights"])
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "resume: optim.master_weights True -> False (converted)"),
        (
            "INFO",
            "resume: optim.store_param_remainders True -> False: no effect (optim.master_weights=false: no master is "
            "kept)",
        ),
    ]
    caplog.clear()
    kept = {"model": {"dtype": "bf16"}, "optim": {**optim, "store_param_remainders": False}}
    with caplog.at_level(logging.INFO, logger="recipes.checkpoint.resume"):
        log_changes(compare(saved, kept), typed=[])
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "resume: optim.store_param_remainders True -> False (converted): this launch does not set "
            "optim.store_param_remainders (add optim.store_param_remainders=true to keep the checkpoint's)",
        )
    ]
    fp32 = {"model": {"dtype": "fp32"}, "optim": optim}
    assert moot("optim.store_param_remainders", {"model.dtype": "fp32", "optim.master_weights": True}) == (
        "model.dtype=fp32: remainders apply to BF16 parameters only"
    )
    assert [c.no_effect for c in compare(saved, {**fp32, "optim": {**optim, "store_param_remainders": False}})] == [
        None,  # model.dtype: refused before anything is logged
        "model.dtype=fp32: remainders apply to BF16 parameters only",
    ]


def test_the_keys_a_command_line_sets_include_a_global_preset_s_own():
    """A group's option sets the keys under the group; an ``experiment`` preset (``@package _global_``) the keys
    of its file and the groups its defaults list overrides (lowmem: ``override /optim``), no others."""
    typed = keys_set(["experiment=lowmem", "++trainer.seed=3", "data=tokens"], CONFIG_DIR)
    assert typed == ["optim", "model.dtype", "run_dir", "trainer.seed", "data"]


NO_DECAY_OFF = ["optim.param_groups.no_decay=[]", "optim.param_groups.no_decay_auto=false"]


@pytest.mark.parametrize("saved_cfg,resumed_cfg", [([], NO_DECAY_OFF), (NO_DECAY_OFF, [])], ids=["off", "on"])
def test_no_decay_patterns_change_across_a_resume(save, saved_cfg, resumed_cfg, tmp_path, resume_live):
    """Groups come from the config by parameter name: each parameter's weight decay follows the config's rule
    (not the checkpoint's value for its group's first parameter), its moments are the checkpoint's for its name."""
    saved = save(tmp_path, *saved_cfg)
    cfg, model, opt, _ = resume_live(tmp_path, *resumed_cfg)
    rule = _by_name(model, build_optimizer(cfg.optim, model))  # the config's groups (a fresh, unloaded optimizer)
    got = _by_name(model, opt)
    decay = {n: saved[f"optim.param_groups.{n}.weight_decay"] for n in got}
    assert any(decay[n] != rule[n]["weight_decay"] for n in got), "the test needs a parameter whose decay changes"
    for name, p in _params(model).items():
        assert got[name]["weight_decay"] == rule[name]["weight_decay"], name
        for s in ("exp_avg", "exp_avg_sq"):
            assert _same(opt.get_unscaled_state(p, s), saved[f"optim.state.{name}.{s}"]), f"{name}.{s}"


# ---------------------------------------------------------------------------------------------------- finished run
def test_a_finished_run_started_with_another_optimizer_config_is_refused(tmp_path, caplog, capsys):
    """Observation 4: the README's next command after the quick start resumes a finished run. A changed key
    would take effect in no step: refused (exit 2 on the command line), nothing recorded; the same config is
    "nothing to do", and adds no launches/ record either (launches/ holds the launches that trained)."""
    train(compose_config([*QUICK, f"run_dir={tmp_path}"]))
    metrics = (tmp_path / "metrics.jsonl").read_text()
    launches = sorted((tmp_path / "launches").iterdir())
    with pytest.raises(ConfigError) as err, caplog.at_level(logging.INFO):
        train(compose_config([*QUICK, f"run_dir={tmp_path}", "optim.exp_avg_dtype=bf16"]))
    line = (
        "run finished at step 20: the config differs from checkpoint step_00000020's (optim.exp_avg_dtype fp32 "
        "-> bf16) but no step is left to train (trainer.max_steps=20); raise trainer.max_steps above 20 or use a new "
        "run_dir"
    )
    assert str(err.value) == line
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    assert sorted((tmp_path / "launches").iterdir()) == launches  # the refused launch's record is gone
    assert (tmp_path / "train.log").read_text().splitlines()[-1].endswith(f"[recipes.train][ERROR] {line}")
    assert not [r for r in caplog.records if r.name == "recipes.checkpoint.resume"]  # no change logged as if applied
    assert "no step is left" not in capsys.readouterr().err  # the console gets the line once, from main()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recipes.train"):
        train(compose_config([*QUICK, f"run_dir={tmp_path}", "trainer.progress=false"]))
    assert "nothing to do: checkpoint step 20 >= 20 (to train on, raise trainer.max_steps)" in [
        r.getMessage() for r in caplog.records
    ]
    assert sorted((tmp_path / "launches").iterdir()) == launches  # a launch that trained nothing is not recorded


def test_a_relaunch_of_a_finished_run_keeps_its_summary(run_at_step_10, tmp_path):
    """The same command again after a run finished trains nothing: metrics.jsonl keeps the last summary (its
    losses and evaluation), not a new one of nulls; the launch's own summary says it trained nothing. Broken on
    purpose (a summary written for every launch): a last record whose first_loss, last_loss and eval are null."""
    run = tmp_path / "run"
    shutil.copytree(run_at_step_10, run)
    before = (run / "metrics.jsonl").read_text()
    last = json.loads(before.splitlines()[-1])
    assert last["kind"] == "summary" and last["last_loss"] is not None and last["end_step"] == 10
    summary = train(compose_config([*QUICK, f"run_dir={run}", "trainer.max_steps=10"]))
    assert (run / "metrics.jsonl").read_text() == before
    assert (summary["start_step"], summary["end_step"], summary["last_loss"]) == (10, 10, None)


def test_a_finished_run_names_stop_at_when_stop_at_ended_it(tmp_path):
    """Stopped by trainer.stop_at=10, started again with max_steps 20 -> 30 and the same stop_at, the refusal names
    trainer.stop_at, not "raise trainer.max_steps above 10" (it is 30 already). Broken on purpose (always
    max_steps)."""
    over = [*QUICK, f"run_dir={tmp_path}", "trainer.stop_at=10"]
    train(compose_config(over))
    with pytest.raises(ConfigError) as err:
        train(compose_config([*over, "trainer.max_steps=30"]))
    assert str(err.value).endswith(
        "but no step is left to train (trainer.stop_at=10); raise trainer.stop_at above 10 or use a new run_dir"
    ), err.value


# ---------------------------------------------------------------------------------------------------- the table
def test_the_docs_render_the_table():
    """docs/reliability.md's resume table is RESUME_RULES rendered; every row names a test of this file."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    assert markdown_table() in text[text.index("## Resume") :]
    assert all(rule_for(r.pattern) is r for r in RESUME_RULES if "*" not in r.pattern)
    tests = {name for name in globals() if name.startswith("test_")}
    assert {r.test for r in RESUME_RULES if r.action != IGNORED} <= tests
    assert T_HYPER_LOG.split("::")[1] in tests


def test_checkpoint_without_a_config_resumes_with_a_warning(save, tmp_path, resume_live, caplog):
    save(tmp_path)
    marker = tmp_path / "checkpoints" / STEP10 / "COMPLETE.json"
    manifest = json.loads(marker.read_text())
    del manifest["config"], manifest[MANIFEST_DIGEST]  # as written before either was recorded
    marker.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="recipes.checkpoint.resume"):
        _, _, _, ckpt = resume_live(tmp_path, "optim.eps=1e-3")
    assert ckpt.loader.resume_changes == []
    assert any("has no config in its manifest" in r.getMessage() for r in caplog.records)
    assert issubclass(ResumeRefused, CheckpointError)
