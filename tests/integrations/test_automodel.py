"""NeMo Automodel 0.7 drop-in, through the recipes' own path: the snippets of docs/drop-in.md, run.

The 0.7 recipes (``llm/train_ft.py``) build the optimizer as ``RecipeConfig(cfg).optimizer`` (Automodel's
``build_optimizer_config`` -> ``OptimizerFromFactoryConfig``) ``.build(model, device_mesh=...)`` and the
checkpointer as ``RecipeConfig(cfg).checkpoint.build(dp_rank=..., ...)``. Here both come from the doc's YAML
block (loaded by Automodel's ``parse_args_and_load_config``, overrides as its command line gives them), and
Automodel's own ``Checkpointer.save_optimizer`` / ``load_optimizer`` round-trip the state on 2 real gloo ranks
(FSDP2 parameters on CPU): the state restored bitwise, the next step the same. Nothing is mocked.

Automodel converts the three dtype options with its ``dtype_from_str`` before our constructor runs; the spellings
it refuses (``fp32``, ``fp16``, ``fp8``, ``float8_e4m3fn``) fail inside Automodel, which these tests pin down.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.integrations import INSTALL

pytest.importorskip(
    "nemo_automodel.recipes._typed_config",
    reason=f"needs NeMo Automodel 0.7's typed recipe config: {INSTALL}",
)

from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE  # noqa: E402
from tests import forked  # noqa: E402
from tests.distributed.launch import PRELOAD, spawn_checks  # noqa: E402
from tests.helpers import drop_in_block, record_exports, same_export_buffers  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:state_dict_cpu_offload=True has no memory effect")

CHECKPOINTER_NEEDS = ("huggingface_hub", "safetensors", "transformers", "tokenizers", "regex", "httpx2")
MISSING = [m for m in CHECKPOINTER_NEEDS if importlib.util.find_spec(m) is None]
needs_checkpointer = pytest.mark.skipif(
    bool(MISSING), reason=f"Automodel's Checkpointer imports {', '.join(MISSING)}: {INSTALL}"
)
PORTABLE = "--optimizer._target_=optim_factory.PortableFusedAdam"


def doc_block(name: str) -> dict:
    """The names the fenced block after ``<!-- drop-in:<name> -->`` in docs/drop-in.md defines, run as written."""
    namespace: dict = {}
    exec(compile(drop_in_block(name), "docs/drop-in.md", "exec"), namespace)
    return namespace


def recipe_path() -> dict:
    """The doc's ``build_like_the_recipe``."""
    return doc_block("automodel-recipe-path")["build_like_the_recipe"]


def recipe_yaml(tmp: Path) -> Path:
    path = tmp / "recipe.yaml"
    path.write_text(drop_in_block("automodel-recipe-yaml"))
    return path


def model(dtype=torch.bfloat16, seed: int = 0, device="cpu") -> torch.nn.Module:
    """Uneven first dims: on 2 ranks, Shard(0) leaves the last Linear's shards empty on rank 1."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3), torch.nn.Linear(3, 1)]
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype)


def train(m: torch.nn.Module, opt, steps: range, rank: int = 0) -> None:
    dtype = next(m.parameters()).dtype
    device = next(m.parameters()).device
    for s in steps:
        gen = torch.Generator().manual_seed(1000 * s + rank)  # each rank its own batch
        m(torch.randn(4, 8, generator=gen).to(device=device, dtype=dtype)).float().square().sum().backward()
        opt.step()
        opt.zero_grad()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = local(a).detach(), local(b).detach()
    assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{what}: {a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}"
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{what}: bits differ"


def assert_same(m1, o1, m2, o2, what: str) -> None:
    """Parameters, live optimizer state (local shards; unscaled too: FP16/FP8 states keep a scale beside them)
    and param groups, bit for bit."""
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert_bitwise(p1, p2, f"{what}: param {n}")
        s1, s2 = o1.state[p1], o2.state[p2]
        assert s1.keys() == s2.keys(), f"{what}: state of {n}: {sorted(s1)} != {sorted(s2)}"
        for k in s1:
            assert_bitwise(s1[k], s2[k], f"{what}: {n}.{k}")
            assert_bitwise(o1.get_unscaled_state(p1, k), o2.get_unscaled_state(p2, k), f"{what}: {n}.{k} unscaled")
    for g1, g2 in zip(o1.param_groups, o2.param_groups):
        assert {k: v for k, v in g1.items() if k != "params"} == {k: v for k, v in g2.items() if k != "params"}


# --- the doc's block, through the recipe's path (one process) ---------------------------------------------------

TARGETS = [
    pytest.param("optim_factory.PortableFusedAdam", "cpu", id="portable"),
    pytest.param(
        "optim_factory.FusedAdam",
        "cuda",
        id="te",
        marks=pytest.mark.skipif(
            not (TE_AVAILABLE and torch.cuda.is_available()), reason="needs Transformer Engine and CUDA"
        ),
    ),
]


@needs_checkpointer
@pytest.mark.parametrize("target, device", TARGETS)
def test_doc_block_through_recipe_config(target, device, tmp_path):
    m = model(device=device)
    (opt,), checkpointer = recipe_path()(
        recipe_yaml(tmp_path), m, [f"--optimizer._target_={target}", f"--checkpoint.checkpoint_dir={tmp_path}"]
    )
    assert type(opt).__name__ == target.rsplit(".", 1)[1]
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-8, 0.1)
    assert (opt.exp_avg_dtype, opt.exp_avg_sq_dtype, opt.master_weight_dtype) == (torch.bfloat16,) * 2 + (
        torch.float32,
    )
    assert opt.master_weights and opt.store_param_remainders
    assert opt.state_dict_cpu_offload and opt.state_dict_offload_chunk_bytes == 64 << 20
    train(m, opt, range(2))
    sd = opt.state_dict()
    assert all(v.device.type == "cpu" for s in sd["state"].values() for v in s.values() if torch.is_tensor(v))
    assert not checkpointer.config.is_async and checkpointer.config.checkpoint_dir == str(tmp_path)
    checkpointer.close()


def optimizer_config(tmp_path: Path, *overrides: str):
    """Only the optimizer section's path (no Checkpointer import): RecipeConfig(...).optimizer."""
    from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
    from nemo_automodel.recipes._typed_config import RecipeConfig

    return RecipeConfig(parse_args_and_load_config(str(recipe_yaml(tmp_path)), argv=[PORTABLE, *overrides])).optimizer


def build_optimizer(tmp_path: Path, *overrides: str, dtype=torch.bfloat16):
    (opt,) = optimizer_config(tmp_path, *overrides).build(model(dtype), device_mesh=None)
    return opt


SURVIVE = {  # spelling -> the dtype our constructor gets (Automodel's dtype_from_str, then ours)
    "bf16": torch.bfloat16,
    "BF16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
    "uint8": torch.uint8,  # FP8 (E4M3): TE's FusedAdam spells it torch.uint8
    "torch.uint8": torch.uint8,
}


@pytest.mark.parametrize("spelling", list(SURVIVE))
def test_moment_spellings_that_survive_automodel(spelling, tmp_path):
    opt = build_optimizer(
        tmp_path,
        f"--optimizer.exp_avg_dtype={spelling}",
        f"--optimizer.exp_avg_sq_dtype={spelling}",
        dtype=torch.float32,
    )
    assert opt.exp_avg_dtype == opt.exp_avg_sq_dtype == SURVIVE[spelling]


@pytest.mark.parametrize("spelling, dtype", [("float32", torch.float32), ("torch.float16", torch.float16)])
def test_master_weight_spellings_that_survive_automodel(spelling, dtype, tmp_path):
    extra = [] if dtype == torch.float32 else ["--optimizer.store_param_remainders=false"]  # remainders: FP32 master
    assert build_optimizer(tmp_path, f"--optimizer.master_weight_dtype={spelling}", *extra).master_weight_dtype == dtype


@pytest.mark.parametrize(
    "key, spelling",
    [("exp_avg_dtype", "fp32"), ("exp_avg_sq_dtype", "fp16"), ("exp_avg_dtype", "fp8"),
     ("exp_avg_sq_dtype", "float8_e4m3fn"), ("master_weight_dtype", "fp32")],
)  # fmt: skip
def test_spellings_automodel_refuses_before_our_constructor(key, spelling, tmp_path):
    """Automodel's dtype_from_str raises a KeyError that names the value, not the key, from ``.build`` (the
    config itself is made without complaint); our constructor never runs, so no message of ours can help."""
    config = optimizer_config(tmp_path, f"--optimizer.{key}={spelling}")
    assert config.kwargs[key] == spelling
    with pytest.raises(KeyError, match=f"^'Unknown dtype string: {spelling}'$"):
        config.build(model(), device_mesh=None)


def test_dtype_automodel_converts_but_fused_adam_refuses_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"^exp_avg_dtype=torch\.float64: FusedAdam only supports"):
        build_optimizer(tmp_path, "--optimizer.exp_avg_dtype=float64")
    with pytest.raises(ValueError, match=r"master_weight_dtype=torch\.bfloat16"):
        build_optimizer(tmp_path, "--optimizer.master_weight_dtype=bf16")


@pytest.mark.skipif(TE_AVAILABLE, reason="checks the message without Transformer Engine")
def test_te_target_without_te_says_what_to_install(tmp_path):
    from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
    from nemo_automodel.recipes._typed_config import RecipeConfig

    cfg = RecipeConfig(parse_args_and_load_config(str(recipe_yaml(tmp_path)), argv=[]))
    with pytest.raises(Exception, match="needs NVIDIA Transformer Engine"):
        cfg.optimizer.build(model(), device_mesh=None)


@needs_checkpointer
def test_exact_checkpointer_reads_the_optimizer_through_a_caller_s_storage_reader(tmp_path):
    """A storage reader a caller gives Automodel's ``_do_load`` for the optimizer's folder (here a subclass, as one
    reading from another store would) is the one that reads it, and the read stays exact: int16 remainders saved,
    an FP32 master resumed, the master is the saved one (DCP's default planner would cast the remainders)."""
    import os

    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from torch.distributed.checkpoint import FileSystemReader

    from optim_factory import PortableFusedAdam
    from optim_factory.integrations.automodel import Checkpointer
    from optim_factory.optimizers.export import join_bf16_remainder

    class RecordingReader(FileSystemReader):  # a real reader that notes what it read
        read: list = []

        def read_data(self, plan, planner):
            self.read = [item.storage_index.fqn for item in plan.items]
            return super().read_data(plan, planner)

    class WithReader(Checkpointer):
        def _do_load(self, state_dict, path, storage_reader=None, is_init_step=False):
            if os.path.basename(path) == "optim":
                self.reader = storage_reader = RecordingReader(path)
            return super()._do_load(state_dict, path, storage_reader, is_init_step)

    config = CheckpointingConfig(enabled=True, checkpoint_dir=str(tmp_path), save_consolidated=False)
    checkpointer = WithReader(config=config, dp_rank=0, tp_rank=0, pp_rank=0)
    saved_model = model()
    saved = PortableFusedAdam(saved_model.parameters(), lr=1e-2, master_weights=True, store_param_remainders=True)
    train(saved_model, saved, range(2))
    checkpointer.save_optimizer(saved, saved_model, str(tmp_path / "step"))
    resumed_model = model(seed=1)
    resumed_model.load_state_dict(saved_model.state_dict())
    resumed = PortableFusedAdam(resumed_model.parameters(), lr=1e-2, master_weights=True)
    checkpointer.load_optimizer(resumed, resumed_model, str(tmp_path / "step"))
    assert any(fqn.endswith(".master_param") for fqn in checkpointer.reader.read), "the caller's reader read nothing"
    for (name, p), q in zip(resumed_model.named_parameters(), saved_model.parameters()):
        want = join_bf16_remainder(q.detach(), saved.state[q]["master_param"])
        assert_bitwise(resumed.state[p]["master_param"], want, f"{name}: the saved FP32 master")
    checkpointer.close()


# --- Automodel's Checkpointer round trip on 2 gloo ranks -----------------------------------------------------------

CASES = {  # name -> (parameter dtype, command-line overrides of the doc's block)
    "doc block: bf16 moments, fp32 master, remainders": (torch.bfloat16, []),
    "state_dict_keep_bf16": (torch.bfloat16, ["--optimizer.state_dict_keep_bf16=true"]),
    "checkpoint.cpu_offload": (torch.bfloat16, ["--checkpoint.cpu_offload=true"]),
    "state_dict_offload_background": (torch.bfloat16, ["--optimizer.state_dict_offload_background=true"]),
    "fp32 params, fp16 + fp8 moments": (
        torch.float32,
        [
            "--optimizer.exp_avg_dtype=float16",
            "--optimizer.exp_avg_sq_dtype=uint8",
            "--optimizer.master_weights=false",
            "--optimizer.store_param_remainders=false",
        ],
    ),
}


TE_CASES = {  # TE's FusedAdam, the doc's block on CUDA (one rank, plain parameters): sync, and async (a GPU's)
    "TE FusedAdam on CUDA": (torch.bfloat16, []),
    "TE FusedAdam on CUDA, checkpoint.is_async": (torch.bfloat16, ["--checkpoint.is_async=true"]),
}


def round_trip(rank: int, world: int, name: str, tmp: str) -> None:
    """Train 3 steps, save_optimizer, load_optimizer into a fresh optimizer of a copy of the model: the state
    is the same bit for bit, and so is the step after. PortableFusedAdam on FSDP2 parameters (CPU); TE's class
    (``TE_CASES``) on one GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    on_gpu = name in TE_CASES
    dtype, overrides = (TE_CASES if on_gpu else CASES)[name]
    mesh = None if on_gpu else init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    build = recipe_path()
    yaml_path = Path(tmp) / "recipe.yaml"
    target = "--optimizer._target_=optim_factory.FusedAdam" if on_gpu else PORTABLE
    overrides = [target, f"--checkpoint.checkpoint_dir={tmp}/ckpt", *overrides]
    step_dir = f"{tmp}/ckpt/epoch_0_step_3"

    def sharded(seed: int) -> torch.nn.Module:
        if on_gpu:
            return model(dtype, seed, device="cuda")
        m = model(dtype, seed)
        fully_shard(m, mesh=mesh)  # FSDP2: DTensor parameters, Shard(0) (Automodel's default strategy)
        return m

    m1 = sharded(0)
    (o1,), checkpointer = build(yaml_path, m1, overrides, device_mesh=mesh, dp_rank=rank)
    train(m1, o1, range(3), rank)
    checkpointer.save_optimizer(o1, m1, step_dir)
    checkpointer.async_wait()  # async: the save finished (a no-op otherwise)

    m2 = sharded(1)
    with torch.no_grad():  # the model's weights as a model checkpoint would restore them
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            p2.copy_(p1)
    (o2,), _ = build(yaml_path, m2, overrides, device_mesh=mesh, dp_rank=rank)
    train(m2, o2, range(7, 8), rank)  # a different state first: the load must replace it
    with torch.no_grad():
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            p2.copy_(p1)
    checkpointer.load_optimizer(o2, m2, step_dir)
    assert_same(m1, o1, m2, o2, f"rank {rank}, after load_optimizer")
    train(m1, o1, range(3, 4), rank)
    train(m2, o2, range(3, 4), rank)
    assert_same(m1, o1, m2, o2, f"rank {rank}, the step after")
    checkpointer.close()


def round_trip_case(rank: int, world: int, name: str, tmp: str) -> None:
    """:func:`round_trip` of one case in a folder of its own (rank 0 writes the doc's YAML there)."""
    import torch.distributed as dist

    if rank == 0:
        Path(tmp).mkdir()
        recipe_yaml(Path(tmp))
    dist.barrier()
    round_trip(rank, world, name, tmp)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, str | None]:
    """Every case on one group of 2 gloo ranks (tests/distributed/launch.py): per case None, or why not."""
    tmp = tmp_path_factory.mktemp("automodel_two_ranks")
    checks = [(name, round_trip_case, (name, str(tmp / f"case{i}"))) for i, name in enumerate(CASES)]
    return spawn_checks(2, checks, tmp / "done")


@needs_checkpointer
@pytest.mark.slow  # starts processes of its own
@pytest.mark.parametrize("name", list(CASES))
def test_checkpointer_round_trip_two_ranks(two_ranks, name):
    assert two_ranks[name] is None, f"{name}: {two_ranks[name]}"


@needs_checkpointer
@pytest.mark.slow
@pytest.mark.skipif(not (TE_AVAILABLE and torch.cuda.is_available()), reason="needs Transformer Engine and CUDA")
def test_te_fused_adam_checkpointer_round_trip_on_cuda(tmp_path):
    outcome = spawn_checks(1, [(name, round_trip_case, (name, str(tmp_path / f"case{i}"))) for i, name in
                               enumerate(TE_CASES)], tmp_path / "done")  # fmt: skip
    assert outcome == dict.fromkeys(TE_CASES), outcome


ASYNC_EXPORT = ["--optimizer.state_dict_offload_background=true", "--optimizer.state_dict_offload_reuse_buffers=true"]


@needs_checkpointer
@pytest.mark.parametrize("in_process", [False, True], ids=["thread", "writer-process"])
def test_async_checkpointer_on_cpu_keeps_its_stagers_across_saves(tmp_path, in_process):
    """checkpoint.is_async: true. Automodel's Checkpointer makes torch's DefaultStager in its constructor (pinned
    memory and non-blocking copies), refused without an accelerator. Ours (the doc's ``exact_checkpointer``) saves on
    CPU through one AsyncSaveStager per kind, the same objects at every save: the optimizer's pooled export buffers
    are the same tensors at every save (given back once written), its background export is deferred (Automodel's
    recipes wait for the staging before the step), and the model and the optimizer load back bitwise, the next step
    the same; with ``write_in_process=True`` each stager's writes in a writer process of its own. (On 1 -> 2 -> 1
    ranks: tests/integrations/test_exact_resume.py.)"""
    from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
    from nemo_automodel.recipes._typed_config import RecipeConfig

    argv = [PORTABLE, "--checkpoint.is_async=true", f"--checkpoint.checkpoint_dir={tmp_path}", *ASYNC_EXPORT]
    if not torch.accelerator.is_available():
        with pytest.raises(AssertionError, match="Non-blocking copy requires that the current accelerator"):
            recipe_path()(recipe_yaml(tmp_path), model(), argv)
    cfg = RecipeConfig(parse_args_and_load_config(str(recipe_yaml(tmp_path)), argv=argv))
    exact_checkpointer = doc_block("automodel-checkpointer")["exact_checkpointer"]

    def wide(seed: int) -> torch.nn.Module:  # a 1024 x 1024 layer: its export fills for milliseconds after the save
        m = model(seed=seed)
        return torch.nn.Sequential(m, torch.nn.Linear(1, 1024), torch.nn.Linear(1024, 1024)).to(torch.bfloat16)

    if in_process:
        from optim_factory.integrations.automodel import Checkpointer

        forked.start_forkserver(PRELOAD)  # the writer processes fork from it, torch imported already
        checkpointer = Checkpointer(cfg.checkpoint, dp_rank=0, tp_rank=0, pp_rank=0, write_in_process=True)
    else:
        checkpointer = exact_checkpointer(cfg)
    m1 = wide(0)
    (o1,) = cfg.optimizer.build(m1, device_mesh=None)
    exports = record_exports(o1)
    stagers = []
    for step in range(3):
        train(m1, o1, range(step, step + 1))
        checkpointer.async_wait()  # Automodel's save_checkpoint waits for the save in flight: its buffers are back
        checkpointer.save_model(m1, f"{tmp_path}/step{step}")
        checkpointer.save_optimizer(o1, m1, f"{tmp_path}/step{step}")
        checkpointer.maybe_wait_for_staging()  # what Automodel's recipes call before the optimizer step
        assert not o1.state_dict_pending  # it waited for the staging's completion, which waited for the export
        stagers.append(dict(checkpointer.stagers))
    checkpointer.async_wait()
    assert stagers[0].keys() == {"model", "optim"} and all(s == stagers[0] for s in stagers), stagers
    assert len(exports) == 3 and same_export_buffers(exports), exports
    assert [deferred for _, deferred in exports] == [True] * 3
    assert all((stager.writer_pid is not None) == in_process for stager in checkpointer.stagers.values())

    m2 = wide(1)
    (o2,) = cfg.optimizer.build(m2, device_mesh=None)
    checkpointer.load_model(m2, f"{tmp_path}/step2/model")
    checkpointer.load_optimizer(o2, m2, f"{tmp_path}/step2")
    assert_same(m1, o1, m2, o2, "after the loads")
    train(m1, o1, range(3, 4))
    train(m2, o2, range(3, 4))
    assert_same(m1, o1, m2, o2, "the step after")
    checkpointer.close()
    for stager in stagers[0].values():
        with pytest.raises(RuntimeError, match="^AsyncSaveStager: closed"):
            stager.stage({})


@needs_checkpointer
def test_async_checkpointer_refuses_remote_storage():
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    from optim_factory.integrations.automodel import Checkpointer

    config = CheckpointingConfig(checkpoint_dir="msc://bucket/run", save_consolidated=False, is_async=True)
    with pytest.raises(ValueError, match=r"^checkpoint.is_async=true with msc://bucket/run: .* local paths only"):
        Checkpointer(config, dp_rank=0, tp_rank=0, pp_rank=0)


@needs_checkpointer
@pytest.mark.parametrize(
    "is_async, in_process", [(False, False), (True, False), (True, True)], ids=["sync", "async", "writer-process"]
)
@pytest.mark.parametrize("budget", [1024, 1 << 16], ids=["below-the-state", "whole-save"])
def test_an_optimizer_with_a_host_budget_saves_within_it_and_loads_bitwise(tmp_path, is_async, in_process, budget):
    """Sync or async, the optimizer's save goes through the stager, which fills each state as DCP writes it (a
    budget of 16 chunks, a third of the state; or one the whole save fits, into kept buffers), also as a writer
    process asks for each (``write_in_process=True``); the optimizer loads back bitwise, the next step the same."""
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    from optim_factory.integrations.automodel import Checkpointer

    options = ["--optimizer.state_dict_cpu_offload=true", "--optimizer.state_dict_offload_chunk_bytes=64"]
    options.append(f"--optimizer.state_dict_offload_host_budget={budget}")
    m1, m2 = model(), model(seed=1)
    (o1,) = optimizer_config(tmp_path, *options).build(m1, device_mesh=None)
    (o2,) = optimizer_config(tmp_path, *options).build(m2, device_mesh=None)
    train(m1, o1, range(2))
    config = CheckpointingConfig(checkpoint_dir=str(tmp_path / "ck"), save_consolidated=False, is_async=is_async)
    checkpointer = Checkpointer(config, dp_rank=0, tp_rank=0, pp_rank=0, write_in_process=in_process)
    checkpointer.save_optimizer(o1, m1, str(tmp_path / "ck" / "step_2"))
    checkpointer.maybe_wait_for_staging()
    checkpointer.async_wait()
    assert (checkpointer.stagers["optim"].writer_pid is not None) == in_process
    assert 0 < checkpointer.stagers["optim"].budget_peak_bytes <= budget
    assert (checkpointer.stagers["optim"].host_bytes > 0) == (budget > 1024)  # the whole save's buffers kept
    m2.load_state_dict(m1.state_dict())
    checkpointer.load_optimizer(o2, m2, str(tmp_path / "ck" / "step_2"))
    assert_same(m1, o1, m2, o2, "after the load")
    train(m1, o1, range(2, 3))
    train(m2, o2, range(2, 3))
    assert_same(m1, o1, m2, o2, "the step after")
    checkpointer.close()


def test_write_in_process_without_is_async_is_one_line(tmp_path):
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    from optim_factory.integrations.automodel import Checkpointer

    config = CheckpointingConfig(checkpoint_dir=str(tmp_path), model_save_format="torch_save", is_async=False)
    with pytest.raises(ValueError, match=r"^Checkpointer\(write_in_process=True\): writes async saves; set checkpoint"):
        Checkpointer(config, dp_rank=0, tp_rank=0, pp_rank=0, write_in_process=True)
