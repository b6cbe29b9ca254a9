"""A changed master format resumed through torchtitan's own ``CheckpointManager`` and Automodel's own
``Checkpointer`` (both read with DCP's default planner, which casts each saved tensor into the template's dtype),
without optim_factory.integrations' checkpointers, on 1 and 2 gloo ranks (FSDP2-style DTensor shards on CPU): every
rank refuses the load in one line naming the fix, and the optimizer is left as it was. The same through plain
DCP, in one process: tests/unit/test_cast_loads.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integrations import INSTALL

pytest.importorskip("torchtitan", reason=f"torchtitan is not installed: {INSTALL}")
pytest.importorskip("nemo_automodel.recipes._typed_config", reason=f"needs NeMo Automodel 0.7: {INSTALL}")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer  # noqa: E402

from optim_factory.integrations import torchtitan as integration  # noqa: E402
from tests.distributed.launch import spawn_checks  # noqa: E402
from tests.helpers import LiveSnapshot  # noqa: E402
from tests.integrations.test_automodel import MISSING, model, recipe_path, recipe_yaml  # noqa: E402
from tests.integrations.test_automodel import train as train_automodel  # noqa: E402
from tests.integrations.test_torchtitan import Net, train  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:state_dict_cpu_offload=True has no memory effect")

FIX = "not loaded: read it with dcp.load(..., planner=ExactLoadPlanner())"
FORMATS = {  # the same on both frameworks: BF16 parameters, CPU-offloaded exports (templates alias no live state)
    "remainders": {"master_weights": True, "store_param_remainders": True},
    "fp32 master": {"master_weights": True, "store_param_remainders": False},
}
SAVED_AS = {"remainders": "saved: int16 remainders", "fp32 master": "saved: an FP32 master"}
PAIRS = [("remainders", "fp32 master"), ("fp32 master", "remainders")]


def refused(optimizer, load, saved: str) -> None:
    """``load()`` raises the one line, and ``optimizer`` is as it was."""
    before = LiveSnapshot.take(optimizer)
    with pytest.raises(ValueError) as info:
        load()
    line = str(info.value)
    assert "\n" not in line and SAVED_AS[saved] in line and FIX in line, line
    LiveSnapshot.take(optimizer).assert_same(before)


def titan(rank: int, world: int, folder: str, saved: str, live: str) -> None:
    """torchtitan's CheckpointManager saves ``saved`` after 3 steps; another run in ``live`` loads it."""
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None

    def build(fmt: str, seed: int):
        model = Net(seed, mesh)
        options = {**FORMATS[fmt], "state_dict_cpu_offload": True}
        optimizers = integration.fused_adam(lr=1e-2, name="PortableFusedAdam", **options).build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
        config = CheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0)
        checkpointer = config.build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states={},
            sd_adapter=None,
        )  # fmt: skip
        return model, optimizers, schedulers, checkpointer

    model, optimizers, schedulers, checkpointer = build(saved, 0)
    train(model, optimizers, schedulers, 0, 3)
    checkpointer.save(curr_step=3)
    checkpointer.close()
    model, optimizers, schedulers, checkpointer = build(live, 1)
    train(model, optimizers, schedulers, 0, 1)
    assert type(checkpointer) is CheckpointManager
    refused(optimizers.optimizers[0], lambda: checkpointer.load(step=3), saved)
    checkpointer.close()


def automodel(rank: int, world: int, folder: str, saved: str, live: str) -> None:
    """Automodel's Checkpointer (the doc's YAML, as its recipes build it) saves ``saved`` after 3 steps; another
    optimizer in ``live`` loads it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if rank == 0:
        Path(folder).mkdir()
        recipe_yaml(Path(folder))
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))

    def build(fmt: str, seed: int):
        m = model(torch.bfloat16, seed)
        fully_shard(m, mesh=mesh)
        overrides = [
            "--optimizer._target_=optim_factory.PortableFusedAdam",
            f"--checkpoint.checkpoint_dir={folder}/ckpt",
            *(f"--optimizer.{k}={str(v).lower()}" for k, v in FORMATS[fmt].items()),
        ]
        (opt,), checkpointer = recipe_path()(Path(folder, "recipe.yaml"), m, overrides, device_mesh=mesh, dp_rank=rank)
        return m, opt, checkpointer

    m, opt, checkpointer = build(saved, 0)
    train_automodel(m, opt, range(3), rank)
    checkpointer.save_optimizer(opt, m, f"{folder}/ckpt/step_3")
    checkpointer.close()
    m, opt, checkpointer = build(live, 1)
    train_automodel(m, opt, range(1), rank)
    assert type(checkpointer).__module__.startswith("nemo_automodel")
    refused(opt, lambda: checkpointer.load_optimizer(opt, m, f"{folder}/ckpt/step_3"), saved)
    checkpointer.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["1 rank", "2 ranks"])
def outcome(request, tmp_path_factory) -> tuple[int, dict[str, str | None]]:
    """Every case on one group of ``world`` gloo ranks: per case None, or why not."""
    world, tmp = request.param, tmp_path_factory.mktemp(f"cast_loads_{request.param}")
    checks = [
        (f"{fn.__name__} {saved}->{live}", fn, (str(tmp / f"{fn.__name__}{i}"), saved, live))
        for fn in ((titan,) + ((automodel,) if not MISSING else ()))
        for i, (saved, live) in enumerate(PAIRS)
    ]
    return world, spawn_checks(world, checks, tmp / "done")


@pytest.mark.slow  # forked ranks
@pytest.mark.parametrize("case", [f"{fn} {a}->{b}" for fn in ("titan", "automodel") for a, b in PAIRS])
def test_a_changed_master_format_through_the_framework_s_own_checkpointer_is_refused(outcome, case):
    world, results = outcome
    if case not in results:
        pytest.skip(f"Automodel's Checkpointer imports {', '.join(MISSING)}: {INSTALL}")
    assert results[case] is None, f"{world} rank(s): {results[case]}"
