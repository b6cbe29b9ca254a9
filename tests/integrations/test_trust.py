"""Checkpoints read as data through the integrations (docs/reliability.md, "Trust"): torchtitan's and Automodel's
own checkpointers' checkpoints (AdamW) load through ours bitwise, and a planted ``.metadata`` or item is refused in
one line before it runs, with nothing of the live model or optimizer changed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.integrations import INSTALL
from tests.planted import RunsACommand, plant_metadata

UNSAFE_METADATA = r"\.metadata holds posix\.system, which is not one of DCP's metadata types: refused before it runs"
UNSAFE_ITEM = r"holds posix\.system, which torch\.load\(weights_only=True\) does not allow: refused before it runs"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torchtitan's and DCP's single-process notes


def snapshot(model: torch.nn.Module, optimizer) -> dict:
    out = {f"param.{k}": v.detach().clone() for k, v in model.named_parameters()}
    for i, state in optimizer.state_dict()["state"].items():
        out.update({f"state.{i}.{k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class WithExtraState(torch.nn.Linear):
    """A layer with an ``_extra_state`` key, as TE's modules have (Automodel reads the checkpoint's metadata itself
    for a model with one)."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.zeros(1)

    def set_extra_state(self, state) -> None:
        pass


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(WithExtraState(4, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


# ---- torchtitan ------------------------------------------------------------------------------------------------


class Extra:
    """A Stateful of the job's ``states``: what it saves is what the attacker chose."""

    def __init__(self, value) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def titan(folder, seed: int, ours: bool, extra=0):
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from optim_factory.integrations import torchtitan as integration

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    manager = integration.CheckpointManager if ours else CheckpointManager
    config = manager.Config(enable=True, folder=str(folder), interval=1, keep_latest_k=0)
    checkpointer = config.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"extra": Extra(extra)}, sd_adapter=None,
    )  # fmt: skip
    return model, optimizers, checkpointer


def titan_saved(folder, extra=0):
    """torchtitan's own CheckpointManager, AdamW, one step, saved as step 1."""
    model, optimizers, checkpointer = titan(folder, 0, ours=False, extra=extra)
    model(torch.randn(2, 4)).sum().backward()
    optimizers.step()
    checkpointer.save(curr_step=1)
    checkpointer.close()
    return snapshot(model, optimizers.optimizers[0])


@pytest.fixture
def torchtitan_installed():
    pytest.importorskip("torchtitan", reason=f"torchtitan is not installed: {INSTALL}")


def test_torchtitan_s_own_checkpoint_loads_through_ours_bitwise(torchtitan_installed, tmp_path):
    saved = titan_saved(tmp_path)
    model, optimizers, checkpointer = titan(tmp_path, 1, ours=True)
    assert checkpointer.load(step=1)
    assert_same(snapshot(model, optimizers.optimizers[0]), saved)
    checkpointer.close()


@pytest.mark.parametrize("planted", ["metadata", "item"])
def test_torchtitan_refuses_a_planted_checkpoint_before_it_runs(torchtitan_installed, tmp_path, planted):
    marker = tmp_path / "ran"
    titan_saved(tmp_path / "ck", extra=RunsACommand(marker) if planted == "item" else 0)
    if planted == "metadata":
        plant_metadata(tmp_path / "ck" / "step-1", marker)
    model, optimizers, checkpointer = titan(tmp_path / "ck", 1, ours=True)
    model(torch.randn(2, 4)).sum().backward()
    optimizers.step()  # states to compare (a load's template creates them)
    before = snapshot(model, optimizers.optimizers[0])
    with pytest.raises(BaseException, match=UNSAFE_METADATA if planted == "metadata" else UNSAFE_ITEM):
        checkpointer.load(step=1)
    assert not marker.exists()
    assert_same(snapshot(model, optimizers.optimizers[0]), before)
    checkpointer.close()


# ---- Automodel -------------------------------------------------------------------------------------------------


@pytest.fixture
def automodel():
    """(Automodel's Checkpointer, ours, the config class), or skipped."""
    pytest.importorskip("nemo_automodel", reason=f"NeMo Automodel is not installed: {INSTALL}")
    missing = [m for m in ("huggingface_hub", "safetensors", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Automodel's Checkpointer imports {', '.join(missing)}: {INSTALL}")
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer as Stock
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    from optim_factory.integrations.automodel import Checkpointer

    return Stock, Checkpointer, CheckpointingConfig


def automodel_saved(automodel, folder, extra=None):
    """Automodel's own Checkpointer: a DCP model (``torch_save``) and its AdamW optimizer, into ``folder``."""
    stock, _, config_class = automodel
    config = config_class(
        enabled=True, checkpoint_dir=str(folder), save_consolidated=False, model_save_format="torch_save"
    )
    model, opt = trained(0)
    if extra is not None:
        opt.param_groups[0]["weight_decay"] = extra  # a value DCP pickles, and a load reads
    checkpointer = stock(config=config, dp_rank=0, tp_rank=0, pp_rank=0)
    checkpointer.save_model(model, str(folder))
    checkpointer.save_optimizer(opt, model, str(folder))
    checkpointer.close()
    return config, snapshot(model, opt)


def test_automodel_s_own_checkpoint_loads_through_ours_bitwise(automodel, tmp_path):
    config, saved = automodel_saved(automodel, tmp_path)
    model, opt = trained(1)
    checkpointer = automodel[1](config=config, dp_rank=0, tp_rank=0, pp_rank=0)
    checkpointer.load_model(model, str(tmp_path / "model"))
    checkpointer.load_optimizer(opt, model, str(tmp_path))
    assert_same(snapshot(model, opt), saved)
    checkpointer.close()


@pytest.mark.parametrize("planted", ["model/.metadata", "optim/.metadata", "optim item"])
def test_automodel_refuses_a_planted_checkpoint_before_it_runs(automodel, tmp_path, planted):
    marker = tmp_path / "ran"
    config, _ = automodel_saved(automodel, tmp_path / "ck", RunsACommand(marker) if planted == "optim item" else None)
    if planted.endswith(".metadata"):
        plant_metadata(tmp_path / "ck" / planted.split("/")[0], marker)
    model, opt = trained(1)
    before = snapshot(model, opt)
    checkpointer = automodel[1](config=config, dp_rank=0, tp_rank=0, pp_rank=0)
    with pytest.raises(BaseException, match=UNSAFE_ITEM if planted == "optim item" else UNSAFE_METADATA):
        if planted.startswith("model"):
            checkpointer.load_model(model, str(tmp_path / "ck" / "model"))
        else:
            checkpointer.load_optimizer(opt, model, str(tmp_path / "ck"))
    assert not marker.exists()
    assert_same(snapshot(model, opt), before)
    checkpointer.close()
