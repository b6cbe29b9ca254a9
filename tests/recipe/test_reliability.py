"""Reliability: kill -9 during training and saves, corrupted checkpoints, config changes, failing saves."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import torch.distributed as dist

from optim_factory import build_optimizer
from recipes.checkpoint import FALLBACK_HINT, CheckpointError, CheckpointManager
from recipes.distributed import DistEnv, init_distributed, shutdown
from recipes.job import shard_model, train
from recipes.model import build_model
from recipes.train import compose_config
from tests.fault import fault_injection
from tests.recipe.runs import QUICK, complete_steps, snapshot


@pytest.mark.slow
def test_fault_injection_reduced(tmp_path, capsys):
    """2 trials per mode of ``python -m tests.fault.fault_injection`` through its ``main`` (the trainers it kills -9
    are processes of their own: at a random step and inside a save; the full run:
    benchmarks/results/2026-11-29-cpu-fault-injection/). Every trial killed its trainer and passed."""
    out, trials = tmp_path / "table.md", tmp_path / "trials.json"
    assert fault_injection.main(["--trials", "2", "--out", str(out), "--json", str(trials)]) == 0, capsys.readouterr()
    done = json.loads(trials.read_text())
    assert [(t["mode"], t["fault"].split()[0]) for t in done] == [
        ("sync", "kill"),
        ("sync", "kill"),
        ("async", "kill"),
        ("async", "kill"),
    ], done
    assert all(t["ok"] and t["killed"] and t["launches"] >= 2 for t in done), done
    assert [t["killed_in_save"] for t in done] == [False, True, False, True], done


def _two_checkpoints(run_dir):
    train(compose_config([*QUICK, f"run_dir={run_dir}"]))  # complete checkpoints at steps 10 and 20
    assert complete_steps(run_dir) == [10, 20]


def _live(cfg):
    """A live model + optimizer with state (one process, gloo), as the recipe builds them."""
    mesh = init_distributed(DistEnv(0, 1, 0, "127.0.0.1", 0, "single"), torch.device("cpu"))
    model = shard_model(build_model(cfg.model, seed=123, device=torch.device("cpu")), mesh)
    opt = build_optimizer(cfg.optim, model)
    x = torch.randint(0, 13, (4, 8))
    model(x, x).backward()
    opt.step()
    return model, opt


def _values(model, opt):
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    states = {(i, k): v.full_tensor().clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()}
    return params, states


def test_truncated_shard_is_one_error_nothing_half_loaded_and_fallback_is_opt_in(tmp_path, caplog):
    _two_checkpoints(tmp_path)
    shard = sorted((tmp_path / "checkpoints" / "step_00000020").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cfg = compose_config([*QUICK, f"run_dir={tmp_path}"])
    try:
        model, opt = _live(cfg)
        before = _values(model, opt)
        with pytest.raises(CheckpointError, match=r"checkpoint .*step_00000020 is damaged: __0_0.distcp: truncated"):
            CheckpointManager(cfg.checkpoint, rank=0, device=torch.device("cpu")).resume(model, opt, {"step": 0})
        after = _values(model, opt)
        for a, b in zip(before, after):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "live state was half-loaded"
        fallback = compose_config([*QUICK, f"run_dir={tmp_path}", "checkpoint.fallback=true"])
        with caplog.at_level(logging.WARNING, logger="recipes.checkpoint"):
            path, state = CheckpointManager(fallback.checkpoint, rank=0, device=torch.device("cpu")).resume(
                model, opt, {"step": 0}
            )
        assert path.name == "step_00000010" and state["step"] == 10
        said = [r.getMessage() for r in caplog.records if "fallback=true: trying the older" in r.getMessage()]
        assert len(said) == 1 and FALLBACK_HINT not in said[0], said  # no advice to do what is being done
    finally:
        shutdown()


def test_deleted_metadata_makes_a_checkpoint_incomplete_and_it_is_skipped(tmp_path, caplog):
    _two_checkpoints(tmp_path)
    (tmp_path / "checkpoints" / "step_00000020" / ".metadata").unlink()
    with caplog.at_level(logging.WARNING, logger="recipes.checkpoint"):
        summary = train(compose_config([*QUICK, f"run_dir={tmp_path}", "trainer.max_steps=25"]))
    assert summary["start_step"] == 10
    said = [r.getMessage() for r in caplog.records if "incomplete" in r.getMessage()]
    assert len(said) == 1 and "step_00000020 (step 20): its save did not finish (no .metadata)" in said[0], said


def test_an_interrupted_save_s_directory_is_removed_by_the_next_launch_once(run_at_step_10, tmp_path, caplog):
    """A second Ctrl-C or a kill during a save leaves ``step_N/`` with some of DCP's files, without ``.metadata``
    or ``COMPLETE.json``: the next launch removes it in one line, and the launch after says nothing of it. Broken
    on purpose (incomplete directories only reported): it stays, and every launch reports it again."""
    run = tmp_path / "run"
    shutil.copytree(run_at_step_10, run)
    cut = run / "checkpoints" / "step_00000020"
    cut.mkdir()
    (cut / "__0_0.distcp").write_bytes(b"partial")
    over = [*QUICK, f"run_dir={run}", "trainer.max_steps=10"]  # nothing to train: the launch's checks only
    with caplog.at_level(logging.INFO, logger="recipes.checkpoint"):
        train(compose_config(over))
    said = [r.getMessage() for r in caplog.records if "incomplete" in r.getMessage()]
    assert said == [
        f"removing the incomplete checkpoint {cut} (step 20): its save did not finish (no .metadata or "
        "COMPLETE.json), nothing can resume from it"
    ], said
    assert not cut.exists() and complete_steps(run) == [10]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recipes.checkpoint"):
        train(compose_config(over))
    assert not [r for r in caplog.records if "incomplete" in r.getMessage()]


def test_checkpoint_of_another_model_shape_is_one_clear_error(tmp_path):
    train(compose_config([*QUICK, f"run_dir={tmp_path}", "trainer.stop_at=10"]))
    before = snapshot(tmp_path / "checkpoints")
    with pytest.raises(CheckpointError) as info:
        train(compose_config([*QUICK, f"run_dir={tmp_path}", "model.d_model=32", "model.d_ff=64"]))
    assert "step_00000010 cannot be resumed with this config: model.d_model" in str(info.value)
    assert "\n" not in str(info.value)
    assert snapshot(tmp_path / "checkpoints") == before
    assert not dist.is_initialized()


# The master format changes (they set the parameter too) trained on after the resume; tests/recipe/test_resume.py
# test_layout_converts checks every accepted change's loaded values, tests/integrations/test_exact_resume.py trains
# on after each through plain DCP and the frameworks.
CHANGES = [
    (["model.dtype=bf16", "optim=fused_adam_lowmem"], ["model.dtype=bf16", "optim.master_weights=true"]),
    (["model.dtype=bf16", "optim.master_weights=true"], ["model.dtype=bf16", "optim=fused_adam_lowmem"]),
]


@pytest.mark.parametrize("saved,resumed", CHANGES, ids=[f"{'+'.join(a)}->{'+'.join(b)}" for a, b in CHANGES])
def test_optimizer_config_changes_between_save_and_resume(saved, resumed, tmp_path):
    train(compose_config([*QUICK, f"run_dir={tmp_path}", "trainer.stop_at=10", *saved]))
    summary = train(compose_config([*QUICK, f"run_dir={tmp_path}", *resumed]))
    assert summary["start_step"] == 10 and summary["end_step"] == 20
    assert summary["last_loss"] is not None and summary["last_loss"] == summary["last_loss"]  # not NaN


class _TwoHeads(torch.nn.Module):
    """``unused`` never gets a gradient; ``frozen_group`` sits alone in a group that never has state."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)
        self.frozen_group = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).sum()


@pytest.mark.parametrize("optim", ["adamw", "fused_adam"])
@pytest.mark.parametrize("flatten", [True, False])
def test_parameters_without_state_and_stateless_groups_save_and_load(optim, flatten, tmp_path):
    """torch issues 192224/192225: a trainable parameter with no state yet, and a group with no state at all,
    behind DCP's (flattened) optimizer dictionaries: saving and resuming work, or fail with one clear line."""
    cfg = compose_config(
        [*QUICK, f"optim={optim}", f"run_dir={tmp_path}", f"checkpoint.flatten_optimizer_state_dict={flatten}"]
    )
    try:
        mesh = init_distributed(DistEnv(0, 1, 0, "127.0.0.1", 0, "single"), torch.device("cpu"))
        from torch.distributed.fsdp import fully_shard

        def build():
            model = fully_shard(_TwoHeads(), mesh=mesh)
            groups = [
                {"params": [*model.used.parameters(), *model.unused.parameters()]},
                {"params": list(model.frozen_group.parameters()), "lr": 0.0},
            ]
            opt = (
                torch.optim.AdamW(groups, lr=1e-2)
                if optim == "adamw"
                else build_optimizer({"backend": "portable"}, model).__class__(groups, lr=1e-2)
            )
            return model, opt

        model, opt = build()
        model(torch.ones(2, 4)).backward()
        opt.step()
        manager = CheckpointManager(cfg.checkpoint, rank=0, device=torch.device("cpu"))
        manager.saver.save(1, model, opt, {"step": 1})
        manager.saver.close()
        model2, opt2 = build()
        try:
            path, state = manager.resume(model2, opt2, {"step": 0})
        except CheckpointError as exc:  # allowed: one clear line naming the checkpoint and the missing state
            # with torch.optim.AdamW: DCP's loader asks for the state that the unused parameter never had
            assert optim == "adamw", f"FusedAdam initialises every parameter's state: {exc}"
            assert "step_00000001" in str(exc) and "Missing key" in str(exc) and "\n" not in str(exc)
            return
        assert state["step"] == 1
        for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor()), n
        for p1, p2 in zip(model.used.parameters(), model2.used.parameters()):
            for k, v in opt.state[p1].items():
                got = opt2.state[p2][k]
                got = got.full_tensor() if hasattr(got, "full_tensor") else got
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
                assert torch.equal(torch.as_tensor(got), torch.as_tensor(v)), k
    finally:
        shutdown()


def test_a_resume_into_a_fresh_optimizer_runs_no_step_and_allocates_no_gradient(tmp_path):
    """The manager creates the fresh optimizer's states with initialize_states() before DCP's template, so DCP's
    zero-gradient step (a gradient allocated for every parameter) never runs; the checkpoint's step count loads."""
    _two_checkpoints(tmp_path)
    cfg = compose_config([*QUICK, f"run_dir={tmp_path}"])
    try:
        mesh = init_distributed(DistEnv(0, 1, 0, "127.0.0.1", 0, "single"), torch.device("cpu"))
        model = shard_model(build_model(cfg.model, seed=123, device=torch.device("cpu")), mesh)
        opt = build_optimizer(cfg.optim, model)
        steps = []
        opt.register_step_pre_hook(lambda o, args, kwargs: steps.append("step"))
        path, state = CheckpointManager(cfg.checkpoint, rank=0, device=torch.device("cpu")).resume(
            model, opt, {"step": 0}
        )
        assert path.name == "step_00000020" and steps == []
        assert all(p.grad is None for p in model.parameters())
        assert {int(g["step"]) for g in opt.param_groups} == {20}
    finally:
        shutdown()
