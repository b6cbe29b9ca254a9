"""The recipe's checkpoint rules that depend on the rank or on the budget, at the level of its ``Saver`` and
``Loader`` (in-process; 2 forked gloo ranks where the world size is what is tested): a save within a host budget
checks the live states for NaN/inf (its export holds placeholders), a fresh run's first-save space check counts
every rank's share, and only rank 0 removes an incomplete step directory."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from optim_factory import PortableFusedAdam
from recipes.checkpoint import CheckpointError, Saver
from recipes.checkpoint.layout import free_bytes
from recipes.checkpoint.load import Loader
from recipes.train import compose_config
from tests.distributed.launch import spawn
from tests.recipe.runs import QUICK


def _checkpoint_cfg(run_dir: Path, *extra: str):
    return compose_config([*QUICK, f"run_dir={run_dir}", *extra]).checkpoint


def _saver(cfg, rank: int = 0) -> Saver:
    return Saver(
        cfg,
        rank=rank,
        device=torch.device("cpu"),
        options=StateDictOptions(),
        write_threads=1,
        save_group=None,
        run_config=None,
        waits_before_step=False,
        on_report=None,
    )


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_within_a_host_budget_refuses_a_nan_in_the_live_optimizer_state(tmp_path, async_save):
    """The export within a budget holds placeholders, filled as they are written: the check reads the optimizer's
    live states. A NaN there (the parameters finite) is refused in one line and nothing is written."""
    cfg = _checkpoint_cfg(tmp_path, f"checkpoint.async_save={async_save}")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = PortableFusedAdam(
        model.parameters(),
        lr=1e-3,
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes=4096,
        state_dict_offload_host_budget=16384,
    )
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    next(iter(opt.state.values()))["exp_avg_sq"].view(-1)[7] = math.nan
    saver = _saver(cfg)
    with pytest.raises(CheckpointError) as info:
        saver.save(1, model, opt, {"step": 1})
        saver.wait()
    line = str(info.value)
    assert line.startswith("not saving step 1: the model or optimizer state holds non-finite values"), line
    assert not (Path(cfg.dir) / "step_00000001").exists()
    saver.close()


def _first_save_check(rank: int, world: int, run_dir: str, estimate: int) -> None:
    """Every rank's share estimated at 3/4 of the free space (the same on every rank: measured once, before the
    ranks start, as the free space moves while other tests write): one fits, two do not."""
    saver = _saver(_checkpoint_cfg(Path(run_dir)), rank)
    saver.root.mkdir(parents=True, exist_ok=True)
    line = saver.first_save_space_problem(estimate)
    assert line is not None and line.endswith(f"the save needs about {world * estimate}"), line


def test_only_rank_0_removes_an_incomplete_step_directory(tmp_path):
    """A save cut short (no metadata, no marker): rank 1 leaves it (rank 0 removes it, in one line)."""
    cfg = _checkpoint_cfg(tmp_path)
    incomplete = Path(cfg.dir) / "step_00000010"
    incomplete.mkdir(parents=True)
    assert Loader(cfg, rank=1, options=StateDictOptions(), run_config=None).candidates() == []
    assert incomplete.is_dir(), "rank 1 removed the incomplete checkpoint"
    assert Loader(cfg, rank=0, options=StateDictOptions(), run_config=None).candidates() == []
    assert not incomplete.exists()


@pytest.mark.slow  # forked gloo ranks
def test_a_fresh_run_s_first_save_space_check_counts_every_rank_s_share(tmp_path):
    spawn(_first_save_check, 2, str(tmp_path), free_bytes(tmp_path) * 3 // 4)
