"""optim_factory.integrations.torchtitan through torchtitan's own code: its config parser and overrides, its
``OptimizersContainer``, its ``CheckpointManager`` (sync and ``async_mode="async"``) on 2 real gloo ranks (CPU),
bitwise, and a resume of the 2-rank checkpoint on 1 rank. The docs' snippets are run as written."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.integrations import INSTALL

pytest.importorskip("torchtitan", reason=f"torchtitan is not installed: {INSTALL}")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402
from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import (  # noqa: E402
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
    default_adamw,
)
from torchtitan.config import ConfigManager, Configurable, OverrideConfig, apply_overrides  # noqa: E402

import optim_factory  # noqa: E402
from optim_factory.checkpoint import AsyncSaveStager, SaveRefused  # noqa: E402
from optim_factory.integrations import torchtitan as integration  # noqa: E402
from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE  # noqa: E402
from tests.distributed.launch import spawn, spawn_checks  # noqa: E402
from tests.helpers import assert_flat_bitwise, drop_in_block, record_exports, same_export_buffers  # noqa: E402

OPTIONS = {  # BF16 moments, FP32 master weights (of BF16 parameters), CPU-offloaded state_dict()
    "master_weights": True,
    "master_weight_dtype": "fp32",
    "exp_avg_dtype": "bf16",
    "exp_avg_sq_dtype": "bf16",
    "state_dict_cpu_offload": True,
}
SHAPES = {"w0": (6, 4), "w1": (4, 6), "bias": (5,)}  # 5 rows: uneven shards on 2 ranks
STEPS = 3
BACKGROUND = {**OPTIONS, "state_dict_offload_background": True, "state_dict_offload_reuse_buffers": True}
ASYNC_MODES = ("async", "async_with_pinned_mem")
# a host budget below the state: 4 chunks of 64 bytes, with the largest item (w0's FP32 master, 96 bytes) in it
BUDGETED = {**OPTIONS, "state_dict_offload_chunk_bytes": 64, "state_dict_offload_host_budget": 256}
WHOLE = {**BUDGETED, "state_dict_offload_host_budget": 1 << 16}  # every save fits: filled into kept buffers
TE_ON_CUDA = TE_AVAILABLE and torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore:state_dict_cpu_offload=True has no memory effect")  # CPU params
DOC_OPTIONS = {k: v for k, v in OPTIONS.items() if k != "master_weight_dtype"}  # the docs' (FP32 master: default)


class Net(torch.nn.Module):
    """BF16 parameters, DTensors sharded on dim 0 over ``mesh`` (what FSDP2 gives an optimizer), plain without."""

    def __init__(self, seed: int, mesh=None, device: str = "cpu"):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            full = torch.randn(shape, generator=gen).to(device=device, dtype=torch.bfloat16)
            value = distribute_tensor(full, mesh, [Shard(0)]) if mesh is not None else full
            self.register_parameter(name, torch.nn.Parameter(value))


def train(model: Net, optimizers, schedulers, first: int, steps: int) -> None:
    """Steps with gradients that depend on the step only, the same on any number of ranks."""
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(1000 + step)
        for p in model.parameters():
            full = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)
            p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()


def build(seed: int, mesh, folder: str, async_mode: str = "disabled", name: str = "PortableFusedAdam",
          manager=CheckpointManager, options: dict = OPTIONS, **fields):  # fmt: skip
    """The model (on CUDA for TE's class), our container and scheduler, and torchtitan's CheckpointManager (or
    ``manager``; ``fields``: more of its config's)."""
    model = Net(seed, mesh, "cuda" if name == "FusedAdam" else "cpu")
    optimizers = integration.fused_adam(lr=1e-2, name=name, **options).build(model_parts=[model])
    assert type(optimizers.optimizers[0]) is getattr(optim_factory, name)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    config = manager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0, async_mode=async_mode, **fields)
    checkpointer = config.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states={},
        sd_adapter=None,
    )  # fmt: skip
    return model, optimizers, schedulers, checkpointer


def snapshot(model: Net, optimizers, full: bool = False) -> dict:
    """The optimizer's flat state dict (what CheckpointManager saves) and the parameters: local shards, or whole."""

    def value(v):
        if isinstance(v, DTensor):
            v = v.full_tensor() if full else v.to_local()
        return v.detach().clone() if isinstance(v, torch.Tensor) else v

    out = {f"optim.{k}": value(v) for k, v in optimizers.state_dict().items()}
    out.update({f"param.{k}": value(v) for k, v in model.named_parameters()})
    return out


# ---- what the ranks run --------------------------------------------------------------------------------------------


def roundtrip_two_ranks(
    rank: int,
    world: int,
    folder: str,
    async_mode: str,
    name: str = "PortableFusedAdam",
    options: dict = OPTIONS,
    fields: dict | None = None,
) -> None:
    """Save after 3 steps, load into fresh objects (other weights): same state and parameters, and the next step
    gives the same bits as the run that never stopped. Writes the whole state for the 1-rank resume. TE's class
    (on CUDA, one rank): the parameters are plain tensors. ``options``: the saving optimizer's (other than
    :data:`OPTIONS`: saved by our manager); ``fields``: more of our manager's config's."""
    mesh = init_device_mesh("cpu", (world,)) if name == "PortableFusedAdam" else None
    manager = CheckpointManager if options is OPTIONS else integration.CheckpointManager
    model, optimizers, schedulers, checkpointer = build(
        0, mesh, folder, async_mode, name, manager, options, **(fields or {})
    )
    train(model, optimizers, schedulers, 0, STEPS)
    assert optimizers.optimizers[0].state_dict()["state"][0]["exp_avg"].device.type == "cpu"
    checkpointer.save(curr_step=STEPS)
    saved, saved_full = snapshot(model, optimizers), snapshot(model, optimizers, full=True)
    checkpointer.maybe_wait_for_saving()  # async: the write goes on while this rank trains on
    if (fields or {}).get("write_in_process"):
        assert checkpointer.stager.writer_pid is not None, "not written by a writer process"
    train(model, optimizers, schedulers, STEPS, 1)
    next_step, next_full = snapshot(model, optimizers), snapshot(model, optimizers, full=True)
    checkpointer.close()

    model, optimizers, schedulers, checkpointer = build(1, mesh, folder, name=name)
    assert checkpointer.load(step=STEPS)
    assert_flat_bitwise(snapshot(model, optimizers), saved)
    train(model, optimizers, schedulers, STEPS, 1)
    assert_flat_bitwise(snapshot(model, optimizers), next_step)
    checkpointer.close()
    if rank == 0:
        torch.save({"saved": saved_full, "next": next_full}, Path(folder, "expected.pt"))


def resume_one_rank(rank: int, world: int, folder: str) -> None:
    """The 2-rank checkpoint into plain (not sharded) parameters on 1 rank: whole state and next step, bitwise."""
    expected = torch.load(Path(folder, "expected.pt"), weights_only=True)
    model, optimizers, schedulers, checkpointer = build(1, None, folder)
    assert checkpointer.load(step=STEPS)
    assert_flat_bitwise(snapshot(model, optimizers), expected["saved"])
    train(model, optimizers, schedulers, STEPS, 1)
    assert_flat_bitwise(snapshot(model, optimizers), expected["next"])
    checkpointer.close()


def saves_through_one_stager(rank: int, world: int, folder: str, async_mode: str, in_process: bool = False) -> None:
    """Our CheckpointManager in an async mode saves 3 times through one AsyncSaveStager: the optimizer's pooled
    export buffers are the same tensors at every save (given back once written), a background export is deferred
    (the stager's ``async_save`` exports torchtitan's states inside its ``exporting()``; in ``async`` the save
    call waits for the staging itself, in ``async_with_pinned_mem`` torchtitan waits for it before the step), one
    that fails on one rank refuses the save on every rank from ``maybe_wait_for_saving``, and ``close()`` closes
    the stager.
    ``in_process``: ``write_in_process=True``, each rank's writes in its writer process, the last save loaded back
    bitwise. (Resumes through these modes: tests/integrations/test_exact_resume.py.)"""
    mesh = init_device_mesh("cpu", (world,))
    fields = {"write_in_process": True} if in_process else {}
    model, optimizers, schedulers, checkpointer = build(
        0, mesh, folder, async_mode, manager=integration.CheckpointManager, options=BACKGROUND, **fields
    )
    stager = checkpointer.stager
    assert type(stager) is AsyncSaveStager
    exports = record_exports(optimizers.optimizers[0])
    for step in range(1, 4):
        train(model, optimizers, schedulers, step, 1)
        checkpointer.save(curr_step=step)
        checkpointer.maybe_wait_for_staging()  # what torchtitan's Trainer calls before the optimizer step
        assert not optimizers.optimizers[0].state_dict_pending  # the staging's completion waited for the export
    checkpointer.maybe_wait_for_saving()
    assert checkpointer.stager is stager and (stager.writer_pid is not None) == in_process
    assert len(exports) == 3 and same_export_buffers(exports), exports
    assert [pending for _, pending in exports] == [True] * 3
    saved = snapshot(model, optimizers) if in_process else None  # the state of save 3 (an export of its own)
    # a deferred export that fails on rank 1: the save is refused on every rank, nothing written
    state = next(iter(optimizers.optimizers[0].state.values()))["exp_avg"].to_local()
    nbytes = state.untyped_storage().nbytes()
    if rank == 1:
        state.untyped_storage().resize_(0)  # the background export fails reading it (a real failure)
    checkpointer.save(curr_step=4)
    checkpointer.maybe_wait_for_staging()
    refused = r"^not saved, nothing was written: the optimizer's background export failed: .* \(rank 1\)$"
    with pytest.raises(SaveRefused, match=refused):
        checkpointer.maybe_wait_for_saving()
    state.untyped_storage().resize_(nbytes)
    assert not Path(folder, "step-4", ".metadata").exists()
    checkpointer.close()
    with pytest.raises(RuntimeError, match="^AsyncSaveStager: closed"):
        stager.stage({})
    assert all(Path(folder, f"step-{s}", ".metadata").is_file() for s in (1, 2, 3))
    if in_process:  # what the writer processes wrote, read back
        model, optimizers, _, checkpointer = build(1, mesh, folder, manager=integration.CheckpointManager)
        assert checkpointer.load(step=3)
        assert_flat_bitwise(snapshot(model, optimizers), saved)
        checkpointer.close()


@pytest.fixture(scope="module")
def two_rank_folders(tmp_path_factory):
    """One group of 2 ranks runs the sync and the async round trip, and our manager's async modes
    (tests/distributed/launch.py)."""
    folders = {mode: str(tmp_path_factory.mktemp(f"titan-{mode}")) for mode in ("disabled", "async")}
    checks = [(mode, roundtrip_two_ranks, (folder, mode)) for mode, folder in folders.items()]
    for mode in ("disabled", "async_with_pinned_mem"):  # within a host budget: filled as written, through the stager
        budget_folder = str(tmp_path_factory.mktemp(f"budget-{mode}"))
        checks.append((f"budget: {mode}", roundtrip_two_ranks, (budget_folder, mode, "PortableFusedAdam", BUDGETED)))
        whole_folder = str(tmp_path_factory.mktemp(f"whole-{mode}"))
        checks.append((f"whole: {mode}", roundtrip_two_ranks, (whole_folder, mode, "PortableFusedAdam", WHOLE)))
    for mode in ASYNC_MODES:
        checks.append((f"ours: {mode}", saves_through_one_stager, (str(tmp_path_factory.mktemp(f"ours-{mode}")), mode)))
    in_process = {"write_in_process": True}  # within the budget, the fills asked for by the writer processes
    budget_process = (
        str(tmp_path_factory.mktemp("budget-process")),
        "async",
        "PortableFusedAdam",
        BUDGETED,
        in_process,
    )
    checks.append(("budget: writer process", roundtrip_two_ranks, budget_process))
    process = (str(tmp_path_factory.mktemp("process")), "async_with_pinned_mem", True)
    checks.append(("ours in a writer process", saves_through_one_stager, process))
    return folders, spawn_checks(2, checks, tmp_path_factory.mktemp("titan-done"))


@pytest.mark.slow  # forked ranks
@pytest.mark.parametrize("async_mode", ASYNC_MODES)
def test_our_async_modes_keep_one_stager_and_reuse_the_export_buffers(two_rank_folders, async_mode):
    _, outcome = two_rank_folders
    assert outcome[f"ours: {async_mode}"] is None, outcome[f"ours: {async_mode}"]


@pytest.mark.slow  # forked ranks
def test_our_async_saves_written_in_writer_processes_load_back_bitwise(two_rank_folders):
    _, outcome = two_rank_folders
    assert outcome["ours in a writer process"] is None, outcome["ours in a writer process"]


def test_write_in_process_without_an_async_mode_is_one_line():
    with pytest.raises(ValueError, match=r"^CheckpointManager.Config\(write_in_process=True\): writes async saves"):
        integration.CheckpointManager.Config(enable=True, write_in_process=True)


@pytest.mark.slow  # forked ranks
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_checkpoint_manager_round_trip_on_two_ranks_is_bitwise(two_rank_folders, async_mode):
    folders, outcome = two_rank_folders
    assert outcome[async_mode] is None, outcome[async_mode]
    assert Path(folders[async_mode], f"step-{STEPS}", ".metadata").is_file()


@pytest.mark.slow  # forked ranks
@pytest.mark.parametrize("async_mode", ["disabled", "async_with_pinned_mem"])
@pytest.mark.parametrize("budget", ["budget", "whole"], ids=["below-the-state", "whole-save"])
def test_an_optimizer_with_a_host_budget_saves_within_it_and_resumes_bitwise(two_rank_folders, async_mode, budget):
    _, outcome = two_rank_folders
    assert outcome[f"{budget}: {async_mode}"] is None, outcome[f"{budget}: {async_mode}"]


@pytest.mark.slow  # forked ranks
def test_saves_within_a_host_budget_written_in_writer_processes_resume_bitwise(two_rank_folders):
    _, outcome = two_rank_folders
    assert outcome["budget: writer process"] is None, outcome["budget: writer process"]


@pytest.mark.slow
@pytest.mark.skipif(not TE_ON_CUDA, reason="TE's FusedAdam: needs Transformer Engine and CUDA (the GPU run)")
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_te_fused_adam_checkpoint_manager_round_trip_on_cuda_is_bitwise(async_mode, tmp_path):
    spawn(roundtrip_two_ranks, 1, str(tmp_path), async_mode, "FusedAdam")


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank_bitwise(two_rank_folders):
    folders, outcome = two_rank_folders
    assert outcome["disabled"] is None, outcome["disabled"]
    spawn(resume_one_rank, 1, folders["disabled"])  # the async save writes the same files


# ---- the docs' snippets, through torchtitan's config parser -----------------------------------------------------


class Job(Configurable):
    """The fields of torchtitan's Trainer.Config that the config parser and the overrides use (Trainer itself
    imports the data stack)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        hf_assets_path: str = "."
        optimizer: OptimizersContainer.Config = field(default_factory=OptimizersContainer.Config)
        override: OverrideConfig = field(default_factory=OverrideConfig)


def stock_job() -> Job.Config:
    """A config_registry function as torchtitan's models write them."""
    return Job.Config(optimizer=default_adamw(lr=3e-4))


def doc_job() -> Job.Config:
    """The docs' config_registry snippet."""
    scope: dict = {}
    exec(drop_in_block("torchtitan-config"), scope)
    return Job.Config(optimizer=scope["optimizer"])


def parse(config_fn: str, *args: str) -> Job.Config:
    """torchtitan's CLI (``--module``/``--config`` and overrides), then the overrides as its Trainer applies them."""
    config = ConfigManager().parse_args(["--module", __name__, "--config", config_fn, *args])
    apply_overrides(config.override, config)
    return config


def check_options(optimizer: torch.optim.Optimizer, lr: float, name: str = "PortableFusedAdam") -> None:
    assert type(optimizer) is getattr(optim_factory, name)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (lr, (0.9, 0.95), 1e-8, 0.1)
    o = optimizer.adam_options
    assert o.master_weights and o.master_weight_dtype == torch.float32
    assert (o.exp_avg_dtype, o.exp_avg_sq_dtype) == (torch.bfloat16, torch.bfloat16)


def test_docs_config_snippet_builds_our_container_through_torchtitans_parser():
    config = parse("doc_job", "--optimizer.implementation", "foreach")  # a CLI override on top: the class stays
    assert type(config.optimizer) is integration.OptimizersContainer.Config
    assert config.optimizer.implementation == "foreach"
    assert config.optimizer.param_groups[0].optimizer_name == "FusedAdam"
    assert config.optimizer.optimizer_factory_kwargs_by_name == {"FusedAdam": DOC_OPTIONS}
    # FusedAdam needs TE and CUDA; the same config with the portable class builds here
    config.optimizer.param_groups[0].optimizer_name = "PortableFusedAdam"
    config.optimizer.optimizer_factory_kwargs_by_name = {"PortableFusedAdam": DOC_OPTIONS}
    optimizers = config.optimizer.build(model_parts=[Net(0)])
    assert type(optimizers) is integration.OptimizersContainer
    check_options(optimizers.optimizers[0], 8e-4)


@pytest.mark.parametrize("name", ["FusedAdam", "PortableFusedAdam"])
def test_docs_override_snippet_swaps_adamw_on_torchtitans_command_line(name):
    args = shlex.split(drop_in_block("torchtitan-override").replace('"name": "FusedAdam"', f'"name": "{name}"'))
    config = parse("stock_job", *args)
    assert type(config.optimizer) is integration.OptimizersContainer.Config
    assert config.optimizer.param_groups[0].optimizer_name == name
    assert config.optimizer.param_groups[0].optimizer_kwargs["lr"] == 3e-4  # the config's own hyperparameters
    assert config.optimizer.optimizer_factory_kwargs_by_name[name] == DOC_OPTIONS
    if name == "FusedAdam" and TE_ON_CUDA:
        check_options(config.optimizer.build(model_parts=[Net(0, device="cuda")]).optimizers[0], 3e-4, name)
    elif name == "FusedAdam":  # resolves to the TE class, which refuses to build without TE
        with pytest.raises(ImportError, match="transformer_engine"):
            config.optimizer.build(model_parts=[Net(0)])
    else:
        check_options(config.optimizer.build(model_parts=[Net(0)]).optimizers[0], 3e-4)


def test_override_options_win_over_the_config_s_and_adam_groups_keep_l2_decay():
    """``use_fused_adam``'s options override the config's: the swapped groups' hyperparameters and the constructor
    options already in ``optimizer_factory_kwargs_by_name``. An ``Adam`` group (L2 weight decay, not decoupled)
    stays torch's Adam with its own hyperparameters, built by torchtitan's container."""
    name = "PortableFusedAdam"
    config = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern="bias", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1}),
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1}),
        ],
        implementation="for-loop",
        optimizer_factory_kwargs_by_name={name: {"master_weights": False, "exp_avg_dtype": "bf16"}},
    )
    swapped = integration.use_fused_adam(config, name=name, lr=5e-4, weight_decay=0.0, master_weights=True)
    assert [pg.optimizer_name for pg in swapped.param_groups] == ["Adam", name]
    assert swapped.optimizer_factory_kwargs_by_name[name] == {"master_weights": True, "exp_avg_dtype": "bf16"}
    adam, ours = swapped.build(model_parts=[Net(0)]).optimizers
    assert type(adam) is torch.optim.Adam and type(ours) is optim_factory.PortableFusedAdam
    assert (adam.param_groups[0]["lr"], adam.param_groups[0]["weight_decay"]) == (1e-3, 0.1)
    assert (ours.param_groups[0]["lr"], ours.param_groups[0]["weight_decay"]) == (5e-4, 0.0)
    assert ours.adam_options.master_weights and ours.adam_options.exp_avg_dtype == torch.bfloat16


def test_override_refuses_a_config_without_adamw_and_an_unknown_name():
    with pytest.raises(ValueError, match="no AdamW param group"):
        integration.use_fused_adam(integration.fused_adam(name="PortableFusedAdam"))
    with pytest.raises(ValueError, match="expected one of FusedAdam, PortableFusedAdam"):
        integration.fused_adam(name="Fused_Adam")


def test_torchtitans_bf16_states_option_is_refused_for_our_classes():
    config = integration.fused_adam(name="PortableFusedAdam")
    config.implementation = "fused_opt_states_bf16"
    with pytest.raises(ValueError, match="^optimizer.implementation=fused_opt_states_bf16 has no effect on Portable"):
        config.build(model_parts=[Net(0)])


def test_torchtitans_own_names_still_resolve():
    optimizers = integration.OptimizersContainer.Config(param_groups=default_adamw(lr=1e-3).param_groups).build(
        model_parts=[Net(0)]
    )
    assert type(optimizers.optimizers[0]) is torch.optim.AdamW


def test_the_docs_script_for_the_checkpoint_manager_outside_the_trainer_runs_on_cpu(tmp_path, monkeypatch):
    """docs/drop-in.md's complete script for torchtitan's CheckpointManager with our optimizer, as written, in this
    process (one gloo rank of its own) in an empty folder: 3 steps, an async save, a resume into fresh objects with
    every optimizer entry equal (its own asserts), and the checkpoint where its comment says."""
    monkeypatch.chdir(tmp_path)
    assert not dist.is_initialized()
    script = drop_in_block("torchtitan-checkpoint-script")
    try:
        exec(compile(script, "docs/drop-in.md torchtitan-checkpoint-script", "exec"), {"__name__": "__main__"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert (tmp_path / "outputs" / "checkpoint" / "step-3" / ".metadata").is_file()


@pytest.mark.slow  # two ranks
def test_the_docs_script_for_the_checkpoint_manager_runs_its_ranks_in_one_group_as_torchrun_starts_them(tmp_path):
    """The same script as ``torchrun --nproc_per_node=2`` runs it (two ranks with its variables): both ranks in
    torchrun's one group, so the checkpoint holds each rank's shard (a private 1-rank group per process would have
    each write the same folder alone)."""
    from tests.distributed.launch import script_ranks

    (tmp_path / "titan_checkpoint.py").write_text(drop_in_block("torchtitan-checkpoint-script"))
    for rank in script_ranks(tmp_path / "titan_checkpoint.py", 2, tmp_path / "ranks"):
        assert rank.returncode == 0, rank.stderr[-3000:]
    files = sorted(p.name for p in (tmp_path / "outputs" / "checkpoint" / "step-3").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files


def test_torchtitans_config_check_warnings_are_logged_once_per_process(caplog):
    """torchtitan's checks warn on its own defaults (``initial_load_model_only`` without an ``initial_load_path``)
    each time a config is made, and ``build()`` makes a copy (``dataclasses.replace``): docs/drop-in.md's script
    builds two configs, four checks. The line is logged once per process (none here where an earlier test said it)."""
    import dataclasses
    import logging

    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            dataclasses.replace(integration.CheckpointManager.Config(enable=True, folder="checkpoint"))
    said = [r for r in caplog.records if "initial_load_model_only" in r.getMessage()]
    assert len(said) <= 1, [r.getMessage() for r in said]


def test_the_once_per_process_filter_lets_each_message_through_once_and_only_inside_apply(caplog):
    import logging

    logger = logging.getLogger("tests.once")
    once = integration.OncePerProcess(logger)
    with caplog.at_level(logging.WARNING, logger="tests.once"):
        once.apply(lambda: [logger.warning(m) for m in ("a", "b", "a", "b")])
        once.apply(logger.warning, "a")
        logger.warning("a")  # outside apply: the filter is off
    assert [r.getMessage() for r in caplog.records] == ["a", "b", "a"]
