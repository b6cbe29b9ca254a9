"""recipes/train.py end to end on CPU: training, DCP checkpoints, resume, retention, torchrun, bad input."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recipes.checkpoint import CheckpointError, is_complete, read_checkpoint
from recipes.data import DataError
from recipes.job import train
from recipes.train import compose_config
from tests.recipe.runs import QUICK, cli, metrics, run_cli, snapshot


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["optim=adamw"],
        ["optim.state_dict_cpu_offload=true", "optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=fp16"],
        ["optim=fused_adam_lowmem", "model.dtype=bf16"],
    ],
    ids=["fused_adam", "adamw", "offload-lowprec", "lowmem-preset"],
)
def test_n_plus_resume_plus_n_is_bitwise_equal_to_2n(extra, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(compose_config([*QUICK, *extra, f"run_dir={straight}"]))
    train(compose_config([*QUICK, *extra, f"run_dir={resumed}", "trainer.stop_at=10"]))
    summary = train(compose_config([*QUICK, *extra, f"run_dir={resumed}"]))
    assert summary["start_step"] == 10
    a = read_checkpoint(straight / "checkpoints" / "step_00000020")
    b = read_checkpoint(resumed / "checkpoints" / "step_00000020")
    assert a.keys() == b.keys()
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert any(k.startswith("model.") for k in tensors) and any(k.startswith("optim.") for k in tensors)
    for k in tensors:
        assert torch.equal(a[k], b[k]), k
    assert not dist.is_initialized()


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("async_save", [False, True])
def test_flatten_and_async_save_resume_continue(flatten, async_save, tmp_path):
    over = [
        *QUICK,
        f"run_dir={tmp_path}",
        f"checkpoint.flatten_optimizer_state_dict={flatten}",
        f"checkpoint.async_save={async_save}",
        "optim.exp_avg_dtype=fp16",
        "optim.state_dict_cpu_offload=true",
    ]
    train(compose_config([*over, "trainer.max_steps=10"]))
    summary = train(compose_config(over))
    assert summary["start_step"] == 10 and summary["end_step"] == 20
    steps = sorted(p for p in (tmp_path / "checkpoints").iterdir() if p.name != ".lock")  # (the run's lock)
    assert [p.name for p in steps] == ["step_00000010", "step_00000020"]
    assert all(is_complete(p) for p in steps)
    reports = [r for r in metrics(tmp_path) if r["kind"] == "checkpoint"]
    assert [r["async_save"] for r in reports] == [async_save, async_save]


def _stray_at_the_first_save(phase, step, path):
    """Puts an incomplete ``step_00000001`` (no .metadata, no marker) into ``checkpoint.dir`` during the first
    save: one that a launch finds is removed before its first step (tests/recipe/test_reliability.py)."""
    if phase == "export" and step == 5:
        stray = path.parent / "step_00000001"
        stray.mkdir()
        (stray / "__0_0.distcp").write_bytes(b"partial")


def test_keep_last_deletes_only_older_complete_checkpoints(tmp_path):
    ckdir = tmp_path / "checkpoints"
    stray = ckdir / "step_00000001"
    over = [*QUICK, f"run_dir={tmp_path}", "checkpoint.every_steps=5", "checkpoint.keep_last=2"]
    train(compose_config(over), on_phase=_stray_at_the_first_save)
    names = sorted(p.name for p in ckdir.iterdir() if p.name != ".lock")  # (the run's lock)
    assert names == ["step_00000001", "step_00000015", "step_00000020"]
    assert (stray / "__0_0.distcp").read_bytes() == b"partial"


def test_incomplete_newest_checkpoint_is_never_loaded(tmp_path):
    train(compose_config([*QUICK, f"run_dir={tmp_path}", "trainer.max_steps=10"]))
    fake = tmp_path / "checkpoints" / "step_00000015"
    shutil.copytree(tmp_path / "checkpoints" / "step_00000010", fake)
    (fake / "COMPLETE.json").unlink()
    (fake / "left_over.bin").write_bytes(b"x")
    summary = train(compose_config([*QUICK, f"run_dir={tmp_path}", "trainer.max_steps=15"]))
    assert summary["start_step"] == 10 and summary["resumed_from"].endswith("step_00000010")
    assert (fake / "COMPLETE.json").exists() and not (fake / "left_over.bin").exists()  # removed, then saved anew


# ------------------------------------------------------------------------------------------------ bad input
def _assert_untouched(before: dict, path: Path) -> None:
    assert snapshot(path) == before


@pytest.mark.parametrize(
    "overrides,error,fragment",
    [
        (
            ["data=tokens", "data.path=/nonexistent/tokens.bin"],
            DataError,
            "data.path='/nonexistent/tokens.bin': no such file",
        ),
        (["checkpoint.resume=/etc"], CheckpointError, "checkpoint.resume='/etc': not a checkpoint directory"),
        (["checkpoint.resume=/nonexistent/step_1"], CheckpointError, "'/nonexistent/step_1': no such directory"),
        (["optim.lr=-1"], ValueError, "optim.lr=-1.0: must be > 0"),
        (["checkpoint.every_steps=0"], CheckpointError, "checkpoint.every_steps=0"),
        (["checkpoint.resume=never"], CheckpointError, "checkpoint.resume=never but checkpoint.dir="),
    ],
    ids=[
        "missing-data-file",
        "resume-not-a-checkpoint",
        "resume-missing",
        "negative-lr",
        "every-steps-0",
        "never-over-existing",
    ],
)
def test_bad_input_fails_before_training_and_touches_nothing(run_at_step_10, overrides, error, fragment):
    before = snapshot(run_at_step_10)
    with pytest.raises(error) as info:
        train(compose_config([*QUICK, f"run_dir={run_at_step_10}", *overrides]))
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert not dist.is_initialized()
    _assert_untouched(before, run_at_step_10)


def test_unwritable_checkpoint_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="not writable"):
        train(compose_config([*QUICK, f"run_dir={tmp_path}", f"checkpoint.dir={blocker}/ckpts"]))
    assert not dist.is_initialized()


def test_malformed_token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\x01\x00\x02")  # odd size
    with pytest.raises(DataError, match="not a whole number of uint16 tokens"):
        train(compose_config([*QUICK, f"run_dir={tmp_path}", "data=tokens", f"data.path={path}"]))


def test_token_file_trains(tmp_path):
    import numpy as np

    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 16, 5000).astype("<u2").tofile(path)
    summary = train(
        compose_config(
            [
                *QUICK,
                f"run_dir={tmp_path}",
                "data=tokens",
                f"data.path={path}",
                "data.seq_len=32",
                "data.eval_size=8",
                "trainer.max_steps=5",
                "checkpoint.every_steps=5",
            ]
        )
    )
    assert summary["end_step"] == 5 and summary["last_loss"] is not None


@pytest.mark.slow
def test_cli_unknown_override_and_user_error_are_short(tmp_path):
    """A refusal as the shell sees it (a process): exit code 2 and exactly one line on stderr, from Hydra's
    composition; one of the recipe's own checks through ``main`` in this process (the others:
    tests/recipe/test_config_errors.py; after training started, as a process: tests/recipe/test_integrity.py)."""
    proc = run_cli([f"run_dir={tmp_path}", "optim.no_such_key=1"])
    assert proc.returncode == 2
    assert proc.stderr == "error: optim.no_such_key: not a config key\n"
    proc = cli(f"run_dir={tmp_path}", "data=tokens", "data.path=/nope.bin")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: data.path='/nope.bin': no such file"], proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_loop_runs_with_its_setup_frozen_out_of_the_collector(tmp_path, unowned_collector):
    """At every save the objects made before the loop are frozen (``gc.freeze``), and they outnumber what the
    collector still tracks, so a generation-2 collection inside a save scans only what the loop made; when the run
    ends, and when its loop raises, they are collected again."""
    seen = []
    phases = lambda phase, step, path: seen.append((gc.get_freeze_count(), len(gc.get_objects())))  # noqa: E731
    train(compose_config([*QUICK, f"run_dir={tmp_path / 'a'}"]), on_phase=phases)
    assert len(seen) == 6 and all(tracked < frozen for frozen, tracked in seen), seen
    assert gc.get_freeze_count() == 0

    def fail(phase, step, path):
        raise RuntimeError("a failure inside the loop")

    with pytest.raises(RuntimeError, match="a failure inside the loop"):
        train(compose_config([*QUICK, f"run_dir={tmp_path / 'b'}"]), on_phase=fail)
    assert gc.get_freeze_count() == 0


def test_objects_frozen_before_the_recipe_s_import_are_no_owner_s_the_loop_freezes_its_setup(
    tmp_path, unowned_collector, monkeypatch
):
    """Python 3.12 starts with 375 objects of its own frozen: what was frozen when the recipe was imported is not an
    owner's policy (here this process's heap frozen, counted as frozen at the import). The loop freezes its setup
    (the count rises past them) and unfreezes everything when it ends."""
    import recipes.job

    gc.freeze()
    try:
        at_import = gc.get_freeze_count()
        monkeypatch.setattr(recipes.job, "_FROZEN_AT_IMPORT", at_import)
        seen = []
        phases = lambda phase, step, path: seen.append(gc.get_freeze_count())  # noqa: E731
        train(compose_config([*QUICK, f"run_dir={tmp_path}"]), on_phase=phases)
        assert len(seen) == 6 and min(seen) > at_import, (at_import, seen)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_where_objects_are_frozen_already_the_loop_leaves_the_collector_to_that_owner(tmp_path, unowned_collector):
    """A process that froze objects itself keeps its policy, though it made more than it froze afterwards: the
    recipe neither freezes its own (they would never be collected) nor unfreezes the owner's."""
    gc.freeze()
    made_after = [[] for _ in range(gc.get_freeze_count() + 1000)]  # tracked, outnumbering the frozen ones
    try:
        owner = gc.get_freeze_count()
        seen = []
        phases = lambda phase, step, path: seen.append(gc.get_freeze_count())  # noqa: E731
        train(compose_config([*QUICK, f"run_dir={tmp_path}"]), on_phase=phases)
        # frozen objects that die leave the count: it may only fall, never rise with the recipe's own
        assert len(made_after) > owner, "the made objects do not outnumber the frozen ones"
        assert len(seen) == 6 and max(seen) <= owner and gc.get_freeze_count() > owner // 2, (owner, seen)
    finally:
        gc.unfreeze()
