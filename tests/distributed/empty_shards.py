"""Empty local shards through the whole optimizer lifecycle (importable by spawned and torchrun'd ranks).

FSDP2 (``fully_shard``) on 2 ranks, with 1-row parameters: rank 1's local shards of ``bias`` and ``row`` are
empty, and with the factory's groups the no-decay group (``bias`` only) is empty on rank 1 as a whole. Every
configuration of ``LIFECYCLE_CONFIGS``, the optimizer built directly and through ``build_optimizer``.
"""

from __future__ import annotations

import warnings

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
from torch.distributed.fsdp import fully_shard

from optim_factory import PortableFusedAdam, build_optimizer
from optim_factory.checkpoint import SafeFileSystemReader, SafeLoadPlanner
from optim_factory.optimizers.export import export_state
from tests.helpers import (
    LIFECYCLE_CONFIGS,
    assert_bitwise,
    assert_state_dicts_bitwise,
    deep_clone,
    grads_for,
    local,
    run_steps,
)

# 2 ranks: weight 3/2 rows, bias 1/0 (empty on rank 1), row 1/0 (empty on rank 1), table 3/3
SHAPES = {"weight": (5, 4), "bias": (1,), "row": (1, 3), "table": (6, 2)}
HP = dict(lr=1e-2, weight_decay=0.1)
VIAS = ("class", "factory")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Tiny(torch.nn.Module):
    """Parameters named as a model's (``bias`` lands in the factory's no-decay group), from ``full`` values."""

    def __init__(self, full: dict[str, torch.Tensor]):
        super().__init__()
        for name, value in full.items():
            self.register_parameter(name, torch.nn.Parameter(value.clone()))


def initial_values(dtype: torch.dtype, seed: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen).to(device=device, dtype=dtype) for n, s in SHAPES.items()}


def make_optimizer(model: torch.nn.Module, backend: str, kw: dict, via: str) -> torch.optim.Optimizer:
    if via == "factory":
        as_text = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in kw.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "offload has no memory effect on CPU"
            return build_optimizer({"backend": backend, **HP, **as_text}, model)
    if backend == "portable":
        return PortableFusedAdam(model.parameters(), **HP, **kw)
    from optim_factory import FusedAdam

    return FusedAdam(model.parameters(), **HP, **kw)


def sharded(mesh, dtype, kw, backend: str, via: str, seed: int = 0):
    model = Tiny(initial_values(dtype, seed, mesh.device_type))
    fully_shard(model, mesh=mesh)
    return model, make_optimizer(model, backend, kw, via)


def assert_same(m1, o1, m2, o2, what: str) -> None:
    """Parameters, every state (empty local shards included) and the step counts, bitwise."""
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters(), strict=True):
        assert_bitwise(a, b, f"{what}: param {n}")
        s1, s2 = o1.state[a], o2.state[b]
        assert s1.keys() == s2.keys() and len(s1) >= 2, f"{what}: states of {n}: {list(s1)} vs {list(s2)}"
        for name in s1:
            assert_bitwise(s1[name], s2[name], f"{what}: {n}.{name}")
    assert steps(o1.param_groups) == steps(o2.param_groups), what


def steps(groups: list[dict]) -> list[int]:
    """Each group's step count (an int, or a tensor with capturable)."""
    return [int(torch.as_tensor(g["step"]).reshape(-1)[0]) for g in groups]


def load_dcp(mesh, dtype, kw, backend, via, path):
    model, opt = sharded(mesh, dtype, kw, backend, via, seed=99)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    loaded = {"model": msd, "optim": osd}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"], options=FLAT)
    return model, opt


def load_state_dict(mesh, dtype, kw, backend, via, model_from, sd):
    model, opt = sharded(mesh, dtype, kw, backend, via, seed=99)
    with torch.no_grad():
        for a, b in zip(model.parameters(), model_from.parameters(), strict=True):
            local(a).copy_(local(b))
    opt.load_state_dict(sd)
    return model, opt


def split_reference(dtype, kw, backend, via, rows: dict[str, list[int]], steps: int):
    """One rank, no distribution: each parameter split into the pieces the ranks hold (empty pieces included,
    named ``shard<r>.<name>`` so that the factory forms the same groups). Per-tensor scales (FP16/FP8 states)
    are then those of the shards, so the gathered state is bitwise this run's, for every configuration."""
    device = "cpu" if backend == "portable" else "cuda"
    full = initial_values(dtype, 0, device)
    model = torch.nn.Module()
    pieces: dict[str, list[torch.nn.Parameter]] = {n: [] for n in SHAPES}
    for r in range(len(next(iter(rows.values())))):
        part = {n: full[n].split(rows[n])[r] for n in SHAPES}
        model.add_module(f"shard{r}", Tiny(part))
        for n in SHAPES:
            pieces[n].append(getattr(model, f"shard{r}").get_parameter(n))
    opt = make_optimizer(model, backend, kw, via)
    for step in range(steps):
        grads = grads_for(step, list(SHAPES.values()), dtype)
        for n, g in zip(SHAPES, grads):
            for p, gp in zip(pieces[n], g.split(rows[n]), strict=True):
                p.grad = gp.to(device).clone()
        opt.step()
        opt.zero_grad()
    return model, opt, pieces


def assert_flat_matches_export(flat: dict, model, opt, export: dict, what: str) -> None:
    """DCP's flattened optimizer state (``state.<fqn>.<name>``) equals the per-state ``export_state``, bitwise."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    order = [p for g in opt.param_groups for p in g["params"]]
    expected = {
        f"state.{name_of[id(order[i])]}.{name}": t for i, st in export["state"].items() for name, t in st.items()
    }
    assert {k for k in flat if k.startswith("state.")} == expected.keys(), f"{what}: flattened keys"
    for key, t in expected.items():
        assert_bitwise(flat[key], t, f"{what}: DCP {key}")


def lifecycle(rank: int, world: int, backend: str, tmp: str, configs: str = "all") -> None:
    """Per configuration (``configs``: ``all`` or names joined by commas) and way of building: 3 steps; export
    with ``state_dict()`` and with DCP's flattened ``get_optimizer_state_dict``, which equals the per-state
    ``export_state(opt, cpu_offload=True)``; DCP save; load each export into a fresh model and optimizer; both
    equal the original bitwise (live states and per-state exports) and, after 2 more steps each, still do.
    Then the full (gathered, ``cpu_offload=True``) optimizer state dict equals a one-rank run bitwise (not for
    int16 remainders: neither gloo nor NCCL all-gathers int16, measured on an H200 pair)."""
    mesh = init_device_mesh("cpu" if backend == "portable" else "cuda", (world,))
    chosen = [c for c in LIFECYCLE_CONFIGS if configs == "all" or c[0] in configs.split(",")]
    assert configs == "all" or len(chosen) == len(configs.split(",")), f"unknown configuration in {configs!r}"
    for cfg, dtype, kw in chosen:
        for via in VIAS:
            what = f"{cfg} via {via}"
            model, opt = sharded(mesh, dtype, kw, backend, via)
            held = {id(p) for g in opt.param_groups for p in g["params"]}
            assert all(id(p) in held for p in model.parameters()), f"{what}: a parameter is not in the optimizer"
            empty = [n for n, p in model.named_parameters() if local(p).numel() == 0]
            assert empty == (["bias", "row"] if rank == 1 else []), f"{what}: rank {rank} empty shards {empty}"
            params = list(model.parameters())
            run_steps(opt, params, 0, 3)
            for n, p in model.named_parameters():
                for name, s in opt.state[p].items():
                    assert local(s).shape == local(p).shape, f"{what}: {n}.{name} {local(s).shape}"

            sd = deep_clone(opt.state_dict())
            per_state = export_state(opt, cpu_offload=True)
            path = f"{tmp}/{cfg}-{via}"
            osd = get_optimizer_state_dict(model, opt, options=FLAT)
            assert_flat_matches_export(osd, model, opt, per_state, what)
            dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=path)
            restored = {
                "dcp": load_dcp(mesh, dtype, kw, backend, via, path),
                "state_dict": load_state_dict(mesh, dtype, kw, backend, via, model, sd),
            }
            for how, (m2, o2) in restored.items():
                assert_same(model, opt, m2, o2, f"{what}: loaded from {how}")
                assert_state_dicts_bitwise(per_state, export_state(o2, cpu_offload=True), f"{what}: {how} export")
            run_steps(opt, params, 3, 2)
            for how, (m2, o2) in restored.items():
                run_steps(o2, list(m2.parameters()), 3, 2)
                assert_same(model, opt, m2, o2, f"{what}: loaded from {how}, 2 more steps")

            if kw.get("store_param_remainders"):
                # no backend all-gathers int16 (gloo: "Invalid scalar type"; NCCL: "Input tensor data type is not
                # supported for NCCL process group: Short", H200s): full state dicts of remainder
                # masters are unsupported; sharded DCP checkpoints of them are (above)
                continue
            gathered = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = get_optimizer_state_dict(model, opt, options=gathered)
            full_model = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
            counts = [0] * world
            dist.all_gather_object(counts, {n: local(p).shape[0] for n, p in model.named_parameters()})
            if rank != 0:
                assert not full.get("state"), f"{what}: DCP's cpu_offload keeps the full state on rank 0 only"
                continue
            rows = {n: [c[n] for c in counts] for n in SHAPES}
            ref_model, ref_opt, pieces = split_reference(dtype, kw, backend, via, rows, steps=5)
            ref = export_state(ref_opt, cpu_offload=True)
            order = [id(p) for g in ref_opt.param_groups for p in g["params"]]
            assert full["state"].keys() == set(SHAPES), f"{what}: full state keys {sorted(full['state'])}"
            for n in SHAPES:
                ref_states = [ref["state"][order.index(id(p))] for p in pieces[n]]
                assert full["state"][n].keys() == ref_states[0].keys(), f"{what}: full {n}"
                for name, t in full["state"][n].items():
                    assert type(t) is torch.Tensor and t.device.type == "cpu", f"{what}: full {n}.{name}"
                    assert_bitwise(t, torch.cat([s[name] for s in ref_states]), f"{what}: full {n}.{name}")
                assert_bitwise(full_model[n], torch.cat([p.detach().cpu() for p in pieces[n]]), f"{what}: {n}")
            counted = steps(full["param_groups"]) + steps(ref["param_groups"])
            assert set(counted) == {5}, f"{what}: steps {counted}"
