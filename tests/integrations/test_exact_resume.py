"""A changed master or moment format, resumed through every path a framework user takes: plain DCP (the README's
loop, with ``ExactLoadPlanner``), torchtitan 0.3's ``CheckpointManager`` (``optim_factory.integrations.torchtitan``)
and Automodel 0.7's ``Checkpointer`` (``optim_factory.integrations.automodel``), on 1 -> 2 -> 1 gloo ranks (forked).

The frameworks' cases save synchronously or asynchronously (torchtitan's ``async`` and ``async_with_pinned_mem``,
Automodel's ``is_async``: through optim_factory's ``AsyncSaveStager``, a background export passed to DCP uncopied).
Each case saves after 3 steps in the saved configuration on 1 rank, resumes in the live one on 2 (once, 1 -> 2: 2
steps and a save), and resumes that checkpoint on 1 (twice, 2 -> 1: 2 steps). After each resume's steps, the
parameters and the whole exported state are bitwise those of a run that never stopped and changed format in memory
at step 3 (``load_state_dict`` of the saved configuration's own state dict into the live configuration, the model
loaded first): the conversion the optimizer defines, the same on every path, whatever order the path loads the model
and the optimizer in. Where the conversion
is exact (an FP32 master and int16 remainders, either way), the FP32 masters are also bitwise those of the run that
never changed format.
"""

from __future__ import annotations

import importlib.util
import json
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.integrations import INSTALL

pytest.importorskip("torchtitan", reason=f"torchtitan is not installed: {INSTALL}")
pytest.importorskip("nemo_automodel", reason=f"NeMo Automodel is not installed: {INSTALL}")
if importlib.util.find_spec("transformers") is None:  # Automodel's Checkpointer imports it
    pytest.skip(f"Automodel's Checkpointer needs transformers: {INSTALL}", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

from optim_factory import PortableFusedAdam  # noqa: E402
from optim_factory.checkpoint import ExactLoadPlanner, SafeFileSystemReader, SafeLoadPlanner  # noqa: E402
from optim_factory.optimizers.export import join_bf16_remainder  # noqa: E402
from tests.distributed.launch import spawn_checks  # noqa: E402
from tests.helpers import drop_in_block  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:state_dict_cpu_offload=True has no memory effect")

SHAPES = {"w0": (6, 4), "w1": (4, 6), "bias": (5,)}  # 5 rows: uneven shards on 2 ranks
HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CONFIGS = {  # BF16 parameters; CPU-offloaded export, as a framework user on a GPU would run it
    "fp32 master": {"master_weights": True},
    "fp16 master": {"master_weights": True, "master_weight_dtype": "fp16"},
    "remainders": {"master_weights": True, "store_param_remainders": True},
    "no master": {},
    "bf16 moments": {"master_weights": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"},
    "bf16 moments, kept bf16": {
        "master_weights": True,
        "exp_avg_dtype": "bf16",
        "exp_avg_sq_dtype": "bf16",
        "state_dict_keep_bf16": True,
    },
}
MASTERS = ("fp32 master", "fp16 master", "remainders", "no master")
PAIRS = [(a, b) for a in MASTERS for b in MASTERS if a != b] + [
    ("fp32 master", "bf16 moments"),
    ("bf16 moments", "fp32 master"),
    ("bf16 moments, kept bf16", "fp32 master"),
    ("fp32 master", "bf16 moments, kept bf16"),
]
# A framework's path differs from plain DCP's in how it reads and in which order it loads the model and the
# optimizer: one pair of each conversion (join, split, from the parameter, dropped, a moment read as saved, an FP16
# master rescaled by a change of world size and split).
FRAMEWORK_PAIRS = [
    ("remainders", "fp32 master"),
    ("fp32 master", "remainders"),
    ("no master", "fp32 master"),
    ("no master", "remainders"),
    ("fp32 master", "no master"),
    ("fp16 master", "remainders"),
    ("bf16 moments, kept bf16", "fp32 master"),
]
# "dcp": the README's loop, whose templates are the live parameters (DCP reads the model in place first);
# "dcp, copies": the same with the model's template a copy (as a checkpointer that reads into host copies has it, the
# recipe's), so that set_state_dict loads the optimizer before the model's values reach the parameters; the
# frameworks' save modes take turns over the pairs (a save mode and a conversion are independent): torchtitan's
# async_mode "async" (docs/drop-in.md's config), "async_with_pinned_mem" ("pinned") and "disabled" ("sync"),
# Automodel's sync and is_async saves; their async saves go through optim_factory's AsyncSaveStager
SAVE_MODES = {"torchtitan": ("", ", pinned", ", sync"), "automodel": ("", ", async")}
CASES = [("dcp", *pair) for pair in PAIRS] + [("dcp, copies", *pair) for pair in FRAMEWORK_PAIRS]
CASES += [
    (f"{name}{modes[i % len(modes)]}", *pair)
    for name, modes in SAVE_MODES.items()
    for i, pair in enumerate(FRAMEWORK_PAIRS)
]
ASYNC_PATHS = ("torchtitan", "torchtitan, pinned", "automodel, async")
# their async saves pass a background export into pooled buffers to DCP uncopied (deferred: the staging's
# completion, which the framework or the save call waits for before the step, waits for it)
ASYNC_EXPORT = {"state_dict_offload_background": True, "state_dict_offload_reuse_buffers": True}
EXACT = {("fp32 master", "remainders"), ("remainders", "fp32 master")}  # the FP32 master carries on unchanged
WORLDS = (1, 2, 1)  # world sizes of the first save, the resume (once: 1 -> 2) and the second resume (twice: 2 -> 1)
SAVED, RESUMED = 3, 5  # the steps of the two checkpoints; each resume trains 2 steps
# of a tensor's largest magnitude, where an FP16 master changed world size: two BF16 ulps (measured: 3.5e-3 at most,
# a parameter one BF16 rounding apart after 2 steps; 1.5e-3 in FP16 masters)
RESCALED_TOLERANCE = 2**-7


def doc_block(name: str) -> dict:
    """The names the fenced block after ``<!-- drop-in:<name> -->`` in docs/drop-in.md defines, run as written."""
    scope: dict = {}
    exec(compile(drop_in_block(name), "docs/drop-in.md", "exec"), scope)
    return scope


class Net(torch.nn.Module):
    """BF16 parameters: DTensors sharded on dim 0 over ``mesh`` (what FSDP2 gives an optimizer), plain without."""

    def __init__(self, seed: int, mesh=None):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            full = torch.randn(shape, generator=gen).to(torch.bfloat16)
            value = distribute_tensor(full, mesh, [Shard(0)]) if mesh is not None else full
            self.register_parameter(name, torch.nn.Parameter(value))

    def set_grads(self, step: int) -> None:
        """Gradients that depend on the step only: the same on any number of ranks."""
        gen = torch.Generator().manual_seed(1000 + step)
        for p in self.parameters():
            full = torch.randn(p.shape, generator=gen).to(p.dtype)
            p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Run:
    """A model and its optimizer as one path builds, saves and loads them (``folder=None``: never saved)."""

    def __init__(self, path: str, config: str, seed: int, mesh, folder: str | None):
        self.path, self.folder, self.model = path, folder, Net(seed, mesh)
        self.framework, _, mode = path.partition(", ")
        options = {
            **HP,
            **CONFIGS[config],
            "state_dict_cpu_offload": True,
            **(ASYNC_EXPORT if path in ASYNC_PATHS else {}),
        }
        self.schedulers = None
        if self.framework == "torchtitan":
            from torchtitan.components.optimizer import LRSchedulersContainer

            from optim_factory.integrations import torchtitan as titan

            self.optimizers = titan.fused_adam(name="PortableFusedAdam", **options).build(model_parts=[self.model])
            self.optimizer = self.optimizers.optimizers[0]
            self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
                optimizers=self.optimizers, training_steps=10
            )
            if folder is not None:  # docs/drop-in.md's config (async), every step, nothing deleted
                config = replace(doc_block("torchtitan-checkpoint")["checkpoint"], folder=folder, interval=1)
                async_mode = {"pinned": "async_with_pinned_mem", "sync": "disabled"}.get(mode, config.async_mode)
                self.manager = replace(config, keep_latest_k=0, async_mode=async_mode).build(
                    dataloader=None, model_parts=[self.model], optimizers=self.optimizers,
                    lr_schedulers=self.schedulers, states={}, sd_adapter=None,
                )  # fmt: skip
        else:
            self.optimizer = PortableFusedAdam(self.model.parameters(), **options)
            if self.framework == "automodel" and folder is not None:
                from nemo_automodel.components.checkpoint.config import CheckpointingConfig

                config = CheckpointingConfig(
                    enabled=True, checkpoint_dir=folder, save_consolidated=False, is_async=mode == "async"
                )
                build = doc_block("automodel-checkpointer")["exact_checkpointer"]  # docs/drop-in.md's
                self.manager = build(SimpleNamespace(checkpoint=config), dp_rank=dist.get_rank())

    def train(self, first: int, steps: int) -> None:
        for step in range(first, first + steps):
            self.model.set_grads(step)
            self.optimizer.step()
            if self.schedulers is not None:
                self.schedulers.step()
            self.optimizer.zero_grad()

    def save(self, step: int) -> None:
        where = f"{self.folder}/step-{step}"
        if self.framework == "torchtitan":
            self.manager.save(curr_step=step)
        elif self.framework == "automodel":  # Automodel saves models as HF safetensors; DCP here, beside its optimizer
            self.manager.save_optimizer(self.optimizer, self.model, where)
            dcp.save({"model": get_model_state_dict(self.model)}, checkpoint_id=f"{where}/model_dcp")
        else:  # the README's loop
            msd, osd = get_state_dict(self.model, self.optimizer, options=FLAT)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
            self.optimizer.release_state_dict(osd)

    def load(self, step: int) -> None:
        where = f"{self.folder}/step-{step}"
        if (
            self.framework == "torchtitan"
        ):  # DCP reads the model in place, loads the optimizer, then torchtitan the model
            assert self.manager.load(step=step)
        elif self.framework == "automodel":  # the model first, as Automodel's recipes load
            state = {"model": get_model_state_dict(self.model)}
            dcp.load(state, storage_reader=SafeFileSystemReader(f"{where}/model_dcp"), planner=SafeLoadPlanner())
            set_model_state_dict(self.model, state["model"])
            self.manager.load_optimizer(self.optimizer, self.model, where)
        else:  # the README's loop (set_state_dict loads the optimizer, then the model)
            msd, osd = get_state_dict(self.model, self.optimizer, options=FLAT)
            if self.path == "dcp, copies":
                msd = {k: v.detach().clone() for k, v in msd.items()}
            state = {"model": msd, "optim": osd}
            dcp.load(state, storage_reader=SafeFileSystemReader(where), planner=ExactLoadPlanner())
            optim = state["optim"]
            set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=optim, options=FLAT)

    def close(self) -> None:
        if hasattr(self, "manager"):  # waits for an async save (torchtitan's and ours)
            self.manager.close()


def full(t):
    if isinstance(t, DTensor) and t.dtype == torch.int16:  # gloo gathers no int16: the same bits as BF16
        local = t.to_local().view(torch.bfloat16)
        t = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
        return t.full_tensor().view(torch.int16)
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def snapshot(run: Run) -> dict:
    """Parameters and the exported state (whole tensors), and each FP32 master (joined from remainders)."""
    sd = run.optimizer.state_dict()
    out = {f"param {n}": full(p) for n, p in run.model.named_parameters()}
    for i, n in enumerate(dict(run.model.named_parameters())):
        for k, v in sd["state"].get(i, {}).items():
            out[f"state {n}.{k}"] = full(v)
    for g, group in enumerate(sd["param_groups"]):
        out.update({f"group {g} {k}": full(v) for k, v in group.items() if k not in ("params", "param_names")})
    return out


def fp32_masters(snap: dict) -> dict:
    masters = {}
    for key, value in snap.items():
        if key.startswith("state ") and key.endswith(".master_param"):
            name = key[len("state ") : -len(".master_param")]
            masters[name] = join_bf16_remainder(snap[f"param {name}"], value) if value.dtype == torch.int16 else value
    return masters


def differences(got: dict, want: dict, tolerance: float = 0.0) -> list[str]:
    """Keys whose values differ: bitwise, or by more than ``tolerance`` times the tensor's largest magnitude."""
    if got.keys() != want.keys():
        return [f"keys differ: {sorted(got.keys() ^ want.keys())}"]
    bad = []
    for key, w in want.items():
        g = got[key]
        if not isinstance(w, torch.Tensor):
            if g != w:
                bad.append(f"{key}: {g!r} != {w!r}")
        elif not (isinstance(g, torch.Tensor) and g.dtype == w.dtype and g.shape == w.shape):
            bad.append(f"{key}: {g.dtype} {tuple(g.shape)} != {w.dtype} {tuple(w.shape)}")
        elif tolerance and not w.is_floating_point():
            continue
        elif tolerance:
            err = (g.double() - w.double()).abs().max().item() / max(w.double().abs().max().item(), 1e-30)
            if err > tolerance:
                bad.append(f"{key} (error {err:.3g})")
        elif not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
            bad.append(key)
    return bad


def reference(path: str, saved: str, live: str, steps: int, mesh) -> tuple[dict, dict]:
    """The run that never stopped (on ``mesh``, or plain: the update is element-wise; nothing saved): ``saved`` for
    3 steps, converted in memory into ``live``, then ``steps`` more; and the run that never changed format."""
    before = Run(path, saved, 0, mesh, None)
    before.train(0, SAVED)
    after = Run(path, live, 1, mesh, None)
    with torch.no_grad():
        for p, q in zip(after.model.parameters(), before.model.parameters()):
            p.copy_(q)
    after.optimizer.load_state_dict(before.optimizer.state_dict())
    if after.schedulers is not None:
        after.schedulers.load_state_dict(before.schedulers.state_dict())
    after.train(SAVED, steps)
    before.train(SAVED, steps)
    return snapshot(after), snapshot(before)


def check(run: Run, mesh, path: str, saved: str, live: str, step: int, rescaled: bool) -> None:
    """``rescaled``: an FP16 master came from a checkpoint of another world size. TE scales an FP16 state per
    local shard (one scale per tensor a rank holds), so its values depend on the sharding it was stored under:
    such a case matches the reference (all of it on this world size) only to FP16's resolution."""
    scaled = "fp16 master" in (saved, live)  # per-shard scales: the reference is sharded as the run
    converted, unchanged = reference(path, saved, live, step - SAVED, mesh if scaled else None)
    got = snapshot(run)
    bad = differences(got, converted, RESCALED_TOLERANCE if rescaled else 0.0)
    if rescaled:  # int16 remainders are low bits: compared as the FP32 masters they make
        bad += differences(fp32_masters(got), fp32_masters(converted), RESCALED_TOLERANCE)
    assert not bad, f"not the in-memory conversion's at step {step}: {bad}"
    if (saved, live) in EXACT:
        bad = differences(fp32_masters(got), fp32_masters(unchanged))
        assert not bad, f"FP32 masters not the unchanged run's at step {step}: {bad}"


def case_folder(root: str, path: str, saved: str, live: str) -> str:
    return f"{root}/{path}/{saved}->{live}".replace(" ", "_").replace(",", "")


def phase(rank: int, world: int, root: str, which: int) -> None:
    """One phase of every case on this group: 1 saves in the saved configuration, 2 resumes it in the live one and
    saves, 3 resumes that. A failing case is recorded (per rank) and the others go on."""
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    failures: dict[str, str] = {}
    failed_before = set()
    for file in Path(root).glob("phase2.*.json"):
        failed_before.update(json.loads(file.read_text()))
    for path, saved, live in CASES:
        case = f"{path}: {saved} -> {live}"
        if which == 3 and case in failed_before:
            continue  # its phase 2 failed (every rank reads the same files) and says why
        run = None
        try:
            if which == 1:
                run = Run(path, saved, 0, mesh, case_folder(root, path, saved, live))
                run.train(0, SAVED)
                run.save(SAVED)
            else:
                run = Run(path, live, 2, mesh, case_folder(root, path, saved, live))
                step = SAVED if which == 2 else RESUMED
                run.load(step)
                run.train(step, RESUMED - SAVED)
                rescaled = (saved if which == 2 else live) == "fp16 master"  # the loaded checkpoint's master
                check(run, mesh, path, saved, live, step + RESUMED - SAVED, rescaled)
                if which == 2:
                    run.save(RESUMED)
        except (Exception, CheckpointException):  # noqa: BLE001  (recorded for the case's test)
            failures[case] = f"phase {which}, rank {rank}:\n{traceback.format_exc()}"
        finally:
            if run is not None:
                run.close()
        dist.barrier()
    Path(root, f"phase{which}.rank{rank}.json").write_text(json.dumps(failures))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, str]:
    """Every case, in three groups of ranks one after the other; per case, what failed (absent: passed)."""
    root = str(tmp_path_factory.mktemp("exact-resume"))
    done = tmp_path_factory.mktemp("exact-resume-done")
    failures: dict[str, str] = {}
    for which, world in enumerate(WORLDS, start=1):
        outcome = spawn_checks(world, [(f"phase {which}", phase, (root, which))], done / str(which))
        failures.update({f"group {name}": why for name, why in outcome.items() if why})
    for file in Path(root).glob("*.json"):
        for case, why in json.loads(file.read_text()).items():
            failures.setdefault(case, why)
    return failures


@pytest.mark.slow  # forked ranks
@pytest.mark.parametrize("path,saved,live", CASES, ids=[f"{p}: {a}->{b}" for p, a, b in CASES])
def test_a_changed_format_resumes_exactly_twice(matrix, path, saved, live):
    groups = [why for name, why in matrix.items() if name.startswith("group ")]
    assert not groups, groups[0]
    why = matrix.get(f"{path}: {saved} -> {live}")
    assert why is None, why
