"""Bodies of the multi-process tests (importable by spawned ranks)."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from optim_factory import build_optimizer
from optim_factory.checkpoint import AsyncSaveStager, SafeFileSystemReader, SafeLoadPlanner
from optim_factory.optimizers.export import export_state
from recipes.checkpoint import CheckpointError, CheckpointManager, state_bytes
from recipes.config import CheckpointConfig
from tests.helpers import FP8, LIFECYCLE_CONFIGS, assert_bitwise, local, run_steps

# uneven Shard(0) on 2 ranks: 3/2 rows, 1/0 rows (an empty local shard), 3/3, 4/3
SHAPES = [(5, 4), (1, 3), (6,), (7, 2)]
_LIFECYCLE = {name: (dtype, kw) for name, dtype, kw in LIFECYCLE_CONFIGS}
CONFIGS = {
    # elementwise states: bitwise equal across world sizes
    "bf16-params-bf16-moments-fp32-master": _LIFECYCLE["bf16-params-bf16-moments-fp32-master"],
    "fp32-params-fp32-states": _LIFECYCLE["fp32"],
    # per-tensor scaled states (scale per local shard)
    "fp16-fp8-moments": (torch.float32, dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=FP8)),
    "bf16-params-remainders": _LIFECYCLE["bf16-params-remainders-bf16-moments"],
    # BF16 moments exported as BF16 (state_dict_keep_bf16): half the bytes, the same results
    "bf16-moments-kept-bf16": (
        torch.bfloat16,
        dict(_LIFECYCLE["bf16-params-bf16-moments-fp32-master"][1], state_dict_keep_bf16=True),
    ),
}
HP = dict(lr=1e-2, weight_decay=0.1)


# backend of the optimizer the workers build: "portable" (CPU tests) or "te" (GPU tests); set per process
BACKEND = {"name": "portable"}


def mesh_device() -> str:
    return "cuda" if BACKEND["name"] == "te" else "cpu"


class ShardedModel(torch.nn.Module):
    """A module whose parameters are DTensors sharded on dim 0 (what FSDP2 gives an optimizer)."""

    def __init__(self, mesh, dtype: torch.dtype, seed: int, shapes=SHAPES):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for i, shape in enumerate(shapes):
            full = torch.randn(shape, generator=gen).to(device=mesh.device_type, dtype=dtype)
            self.register_parameter(f"w{i}", torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))


def optim_config(cfg: str, offload: bool, **extra) -> dict:
    """The factory config of one of CONFIGS (dtypes as strings, as a YAML file would spell them)."""
    _, kw = CONFIGS[cfg]
    as_text = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in kw.items()}
    return {"backend": BACKEND["name"], **HP, "state_dict_cpu_offload": offload, **as_text, **extra}


def build(mesh, cfg: str, seed: int = 0, offload: bool = True, shapes=SHAPES, **extra):
    dtype, _ = CONFIGS[cfg]
    model = ShardedModel(mesh, dtype, seed, shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "offload has no memory effect on CPU"
        opt = build_optimizer(optim_config(cfg, offload, **extra), model)
    return model, opt


def optimized_params(model, opt) -> list[torch.nn.Parameter]:
    """The model's parameters, each held by the optimizer (empty local shards included)."""
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    params = list(model.parameters())
    assert all(id(p) in held for p in params), "a parameter is missing from the optimizer"
    return params


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def assert_same_model_and_state(m1, o1, m2, o2, what: str) -> None:
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert_bitwise(a, b, f"{what} param {n}")
    for p1, p2 in zip(optimized_params(m1, o1), optimized_params(m2, o2)):
        s1, s2 = o1.state[p1], o2.state[p2]
        assert s1.keys() == s2.keys(), what
        for name in s1:
            assert_bitwise(s1[name], s2[name], f"{what} state {name}")
    assert [g["step"] for g in o1.param_groups] == [g["step"] for g in o2.param_groups]


def load_fresh(mesh, cfg: str, path: str, options: StateDictOptions, **build_kw):
    """A fresh model + optimizer (other seed) with the DCP checkpoint at ``path`` loaded into them."""
    model, opt = build(mesh, cfg, seed=99, **build_kw)
    msd, osd = get_state_dict(model, opt, options=options)
    loaded = {"model": msd, "optim": osd}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"], options=options)
    return model, opt


def dcp_roundtrip(rank: int, world: int, cfg: str, tmp: str) -> None:
    """flatten False/True x dcp.save/async_save: save, load into a fresh model+optimizer, continue."""
    mesh = init_device_mesh(mesh_device(), (world,))
    model, opt = build(mesh, cfg)
    run_steps(opt, list(model.parameters()), 0, 3)
    restored = []
    for flatten in (False, True):
        for mode in ("sync", "async"):
            options = StateDictOptions(flatten_optimizer_state_dict=flatten)
            state = {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, opt, options=options),
            }
            # offloaded states: DTensors with CPU local tensors, the parameter's mesh and placements
            for v in state["optim"]["state"].values() if not flatten else []:
                for t in v.values():
                    assert isinstance(t, DTensor) and t.placements == (Shard(0),)
            path = f"{tmp}/ckpt-{cfg}-{flatten}-{mode}"
            if mode == "sync":
                dcp.save(state, checkpoint_id=path)
            else:
                dcp.async_save(state, checkpoint_id=path).result()
            model2, opt2 = load_fresh(mesh, cfg, path, options)
            assert_same_model_and_state(model, opt, model2, opt2, f"{cfg} flatten={flatten} {mode} after load")
            restored.append((model2, opt2, f"{flatten}-{mode}"))
    run_steps(opt, list(model.parameters()), 3, 2)
    for model2, opt2, what in restored:
        run_steps(opt2, list(model2.parameters()), 3, 2)
        assert_same_model_and_state(model, opt, model2, opt2, f"{cfg} {what} continued")


# the chunked export: (chunk budget, shapes) on CPU (tiny budget, many chunks per local shard) and on CUDA
# (1 MiB chunks; local shards of up to 8 MiB in FP32)
CHUNKED = {"cpu": (64, SHAPES), "cuda": (1 << 20, [(4096, 1024), (1001, 3), (8192, 512), (7,)])}


def chunked_export(rank: int, world: int, tmp: str) -> None:
    """Chunked (fresh and reused buffers) == per-state export, bitwise: ``state_dict()`` and DCP's flattened
    ``get_optimizer_state_dict``; on CUDA the DCP export stays within 2 chunks of GPU memory; an async DCP
    save of a reused-buffer export loads back bitwise, also when the export is filled in the background
    (``state_dict_offload_background``: DCP's async save starts while it runs, the stager waits for it)."""
    device = mesh_device()
    chunk, shapes = CHUNKED[device]
    mesh = init_device_mesh(device, (world,))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for cfg in CONFIGS:
        ref_model, ref_opt = build(mesh, cfg, shapes=shapes, state_dict_offload_chunk_bytes=0)  # per state
        run_steps(ref_opt, list(ref_model.parameters()), 0, 3)
        ref_flat = get_optimizer_state_dict(ref_model, ref_opt, options=flat)
        for reuse, background in ((False, False), (True, False), (True, True)):
            model, opt = build(  # the same model, steps and states as the reference's, exported in chunks
                mesh,
                cfg,
                shapes=shapes,
                state_dict_offload_chunk_bytes=chunk,
                state_dict_offload_reuse_buffers=reuse,
                state_dict_offload_background=background,
            )
            run_steps(opt, list(model.parameters()), 0, 3)
            assert_same_model_and_state(ref_model, ref_opt, model, opt, f"{cfg} reuse={reuse} background={background}")
            reference = export_state(opt, cpu_offload=True, keep_bf16=opt.state_dict_keep_bf16)  # per state
            for round_ in range(2):
                what = f"{cfg} reuse={reuse} background={background} round {round_}"
                sd = opt.state_dict()
                opt.wait_state_dict()  # a background export's values are read below
                for k, st in reference["state"].items():
                    for name, v in st.items():
                        _assert_same_dtensor(sd["state"][k][name], v, f"{what} state_dict {k}.{name}")
                opt.release_state_dict(sd)
                if device == "cuda":
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                with opt.deferred_state_dict():  # a background export returns unfilled: the async save overlaps it
                    got = get_optimizer_state_dict(model, opt, options=flat)
                path = f"{tmp}/chunked-{cfg}-{background}"
                save = reuse and round_ == 1
                if save and background:  # DCP stages the export while it is being filled: the stager waits
                    _async_save(model, opt, got, path)
                opt.wait_state_dict()
                seconds = time.perf_counter() - t0  # with background and save: the save's time included
                if save and not background:
                    _async_save(model, opt, got, path)
                assert got.keys() == ref_flat.keys(), what
                for key, v in ref_flat.items():
                    if isinstance(v, torch.Tensor):
                        _assert_same_dtensor(got[key], v, f"{what} DCP {key}")
                    else:
                        assert got[key] == v, f"{what} DCP {key}"
                if device == "cuda":
                    peak = torch.cuda.max_memory_allocated() - base
                    nbytes = state_bytes(got)
                    print(
                        "CHUNKED_DCP "
                        + json.dumps(
                            dict(
                                rank=rank,
                                cfg=cfg,
                                reuse=reuse,
                                background=background,
                                includes_save=save and background,
                                round=round_,
                                chunk_bytes=chunk,
                                peak_bytes=peak,
                                bytes=nbytes,
                                seconds=seconds,
                                gbps=nbytes / seconds / 1e9,
                            )
                        ),
                        flush=True,
                    )
                    assert peak <= 2 * chunk + (1 << 20), f"{what}: DCP export peak {peak} > 2 x {chunk} + 1 MiB"
                if save:
                    opt.release_state_dict(got)
                    model2, opt2 = load_fresh(
                        mesh, cfg, path, flat, shapes=shapes, state_dict_offload_chunk_bytes=chunk
                    )
                    assert_same_model_and_state(model, opt, model2, opt2, f"{cfg} chunked async save, loaded")
                else:
                    opt.release_state_dict(got)


def _async_save(model, opt, osd, path: str) -> None:
    state = {"model": get_model_state_dict(model), "optim": osd}
    dcp.async_save(state, checkpoint_id=path, async_stager=AsyncSaveStager(opt)).upload_completion.result()


def _assert_same_dtensor(a, b, what: str) -> None:
    assert type(a) is type(b), f"{what}: {type(a)} vs {type(b)}"
    if isinstance(a, DTensor):
        assert a.placements == b.placements and a.device_mesh == b.device_mesh, what
        assert a.shape == b.shape and a.stride() == b.stride(), what
        assert a._local_tensor.device.type == "cpu", what
    assert_bitwise(a, b, what)


def full_state_export(rank: int, world: int, cfg: str, tmp: str) -> None:
    """full_state_dict=True with and without DCP's cpu_offload equals the gathered sharded export (uneven
    shards, one of them empty on rank 1)."""
    mesh = init_device_mesh(mesh_device(), (world,))
    model, opt = build(mesh, cfg)
    run_steps(opt, list(model.parameters()), 0, 3)
    sharded = get_optimizer_state_dict(model, opt)
    expected = {fqn: {n: t.full_tensor() for n, t in st.items()} for fqn, st in sharded["state"].items()}
    for cpu_offload in (False, True):
        full = get_optimizer_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
        )
        if cpu_offload and rank != 0:
            assert full == {} or not full.get("state"), "DCP cpu_offload keeps the full state on rank 0 only"
            continue
        assert full["state"].keys() == expected.keys()
        for fqn, st in full["state"].items():
            for n, t in st.items():
                assert not isinstance(t, DTensor) and t.shape == expected[fqn][n].shape
                assert_bitwise(t, expected[fqn][n], f"full {fqn}.{n} cpu_offload={cpu_offload}")


def save_for_reshard(rank: int, world: int, cfg: str, tmp: str) -> None:
    """Save at step 3 (flattened), then record the full parameters after one more step."""
    mesh = init_device_mesh(mesh_device(), (world,))
    model, opt = build(mesh, cfg)
    run_steps(opt, list(model.parameters()), 0, 3)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/reshard-{cfg}-w{world}")
    run_steps(opt, list(model.parameters()), 3, 1)
    params = full_params(model)
    if rank == 0:
        torch.save(params, f"{tmp}/after-step-{cfg}-w{world}.pt")
    dist.barrier()


def load_resharded(rank: int, world: int, cfg: str, tmp: str, saved_world: int) -> None:
    """Load a checkpoint written by ``saved_world`` ranks, take one step, compare to that run's next step."""
    mesh = init_device_mesh(mesh_device(), (world,))
    model, opt = build(mesh, cfg, seed=99)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=options)
    loaded = {"model": msd, "optim": osd}
    dcp.load(
        loaded, storage_reader=SafeFileSystemReader(f"{tmp}/reshard-{cfg}-w{saved_world}"), planner=SafeLoadPlanner()
    )
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"], options=options)
    run_steps(opt, list(model.parameters()), 3, 1)
    expected = torch.load(f"{tmp}/after-step-{cfg}-w{saved_world}.pt")
    for n, t in full_params(model).items():
        assert_bitwise(t, expected[n], f"{cfg}: {saved_world}->{world} ranks, param {n} after the next step")


def async_save_while_training(rank: int, world: int, tmp: str) -> None:
    """The recipe's CheckpointManager with async saves, while training's collectives run on the default group:
    DCP's background thread plans and finishes each save with collectives of its own, which must not interleave
    with the training's on the same group (gloo: "collective mismatch" abort; NCCL: a hang). Then the last
    checkpoint loads back bitwise."""
    mesh = init_device_mesh(mesh_device(), (world,))
    cfg = "fp32-params-fp32-states"
    shapes = [(4096, 1024)] * 4  # 16M elements: 2 x 32 MiB of states per rank to write, so saves take a while
    model, opt = build(
        mesh, cfg, shapes=shapes, state_dict_offload_chunk_bytes=1 << 20, state_dict_offload_reuse_buffers=True
    )
    params = optimized_params(model, opt)
    ckpt = CheckpointManager(
        CheckpointConfig(dir=f"{tmp}/ck", every_steps=1, keep_last=0, async_save=True),
        rank=rank,
        device=torch.device(mesh_device()),
    )
    for step in (1, 2, 3):
        run_steps(opt, params, step, 1)
        ckpt.saver.save(step, model, opt, {"step": step})
        for _ in range(300):  # the training's collectives, while the save is in flight (same count on every rank)
            dist.all_reduce(torch.ones(1024, device=mesh_device()))
    ckpt.saver.close()
    dist.barrier()  # rank 0 writes the completion markers
    assert [s for s, _ in ckpt.complete()] == [1, 2, 3]
    model2, opt2 = load_fresh(
        mesh, cfg, f"{tmp}/ck/step_00000003", StateDictOptions(flatten_optimizer_state_dict=True), shapes=shapes
    )
    assert_same_model_and_state(model, opt, model2, opt2, "async saves during training, loaded")


def background_export_failure(rank: int, world: int, tmp: str) -> None:
    """``state_dict_offload_background``: a background export that fails on one rank refuses the recipe's save on
    every rank (one line each, no hang, the step directory removed) when the save is finalised; training goes on
    meanwhile, and once the cause is gone the next save completes."""
    mesh = init_device_mesh(mesh_device(), (world,))
    cfg = "bf16-params-bf16-moments-fp32-master"
    model, opt = build(
        mesh,
        cfg,
        state_dict_offload_chunk_bytes=64,
        state_dict_offload_background=True,
        state_dict_offload_reuse_buffers=True,
    )
    params = optimized_params(model, opt)
    ckpt = CheckpointManager(
        CheckpointConfig(dir=f"{tmp}/ck", every_steps=1, keep_last=0, async_save=True),
        rank=rank,
        device=torch.device(mesh_device()),
        waits_before_step=True,  # as the recipe: wait_export() before step()
    )
    run_steps(opt, params, 1, 1)
    ckpt.saver.save(1, model, opt, {"step": 1})
    ckpt.saver.wait()
    broken = None
    if rank == 0:  # a state whose storage is gone: the background thread fails reading it (no mock)
        broken = next(st["exp_avg"] for st in opt.state.values() if local(st["exp_avg"]).numel() > 0)
        nbytes, values = local(broken).untyped_storage().nbytes(), local(broken).clone()
        local(broken).untyped_storage().resize_(0)
    ckpt.saver.save(2, model, opt, {"step": 2})  # deferred (async, background, reused buffers): returns at once
    ckpt.saver.wait_export()  # what the loop does before step(): never raises, the failure is the save's
    if broken is not None:  # the state as it was (resize_ gives uninitialised memory), before the next step
        local(broken).untyped_storage().resize_(nbytes)
        local(broken).copy_(values)
    run_steps(opt, params, 2, 1)  # the optimizer goes on: the save took the export's failure
    try:
        ckpt.saver.wait()
    except CheckpointError as exc:
        # every rank names rank 0's failure
        assert "not saving step 2: the optimizer's background export failed" in str(exc), exc
        assert "storage" in str(exc) and "(rank 0)" in str(exc), exc
        assert "\n" not in str(exc)
    else:
        raise AssertionError(f"rank {rank}: a failed background export was saved")
    dist.barrier()
    assert not (Path(tmp) / "ck" / "step_00000002").exists()
    ckpt.saver.save(3, model, opt, {"step": 3})
    ckpt.saver.close()
    dist.barrier()
    assert [s for s, _ in ckpt.complete()] == [1, 3]


def non_finite_on_one_rank(rank: int, world: int, tmp: str) -> None:
    """A NaN in one rank's shard alone refuses the recipe's save on every rank, synchronous and async (the verdict
    is agreed: one collective), one line each, no step directory; once the cause is gone the next save completes."""
    mesh = init_device_mesh(mesh_device(), (world,))
    model, opt = build(mesh, "fp32-params-fp32-states")
    params = optimized_params(model, opt)
    run_steps(opt, params, 1, 1)
    for async_save in (False, True):
        folder = Path(tmp) / f"ck-async-{async_save}"
        config = CheckpointConfig(dir=str(folder), every_steps=1, keep_last=0, async_save=async_save)
        ckpt = CheckpointManager(config, rank=rank, device=torch.device(mesh_device()))
        ckpt.saver.save(1, model, opt, {"step": 1})
        ckpt.saver.wait()
        state = next(local(st["exp_avg"]) for st in opt.state.values() if local(st["exp_avg"]).numel() > 0)
        kept = state.clone()
        if rank == 0:  # this rank's shard only: every other rank sees finite values
            state.view(-1)[0] = float("nan")
        try:
            ckpt.saver.save(2, model, opt, {"step": 2})
            ckpt.saver.wait()
        except CheckpointError as exc:
            assert "not saving step 2: the model or optimizer state holds non-finite values" in str(exc), exc
            assert "\n" not in str(exc)
        else:
            raise AssertionError(f"rank {rank}, async_save={async_save}: a state with NaN on rank 0 was saved")
        state.copy_(kept)
        dist.barrier()
        assert not (folder / "step_00000002").exists()
        ckpt.saver.save(3, model, opt, {"step": 3})
        ckpt.saver.close()
        dist.barrier()  # rank 0 writes the completion markers
        assert [s for s, _ in ckpt.complete()] == [1, 3], (async_save, ckpt.complete())


def host_wraps_keep_their_mesh(rank: int, world: int) -> None:
    """``wrap_host_local`` shares one spec per layout, but never across mesh objects: two meshes of the same layout
    are equal (``DeviceMesh.__eq__``) yet each wrap must carry the parameter's own (its rank coordinate places the
    shard in a checkpoint)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from optim_factory.optimizers.export import wrap_host_local

    meshes = [init_device_mesh("cpu", (world,)) for _ in range(2)]
    assert meshes[0] == meshes[1] and meshes[0] is not meshes[1]
    for mesh in (*meshes, meshes[0]):
        param = distribute_tensor(torch.zeros(4 * world, 3), mesh, [Shard(0)])
        wrapped = wrap_host_local(torch.ones(4, 3), param)
        assert wrapped.device_mesh is mesh and wrapped.placements == param.placements
        assert wrapped.shape == param.shape and wrapped.to_local().data_ptr() != param.to_local().data_ptr()
