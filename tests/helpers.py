"""Shared test helpers: optimizer configurations, deterministic gradients, state snapshots."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

FP8 = torch.uint8  # TE's spelling of FP8 E4M3 in FusedAdam's arguments

# name, param dtype, optimizer kwargs. Together: FP32/FP16/BF16/FP8 moments, FP32/FP16 masters, int16
# remainders, capturable, L2 mode; each runs with state_dict_cpu_offload off and on.
LIFECYCLE_CONFIGS: list[tuple[str, torch.dtype, dict]] = [
    ("fp32", torch.float32, {}),
    ("fp16-moments", torch.float32, dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)),
    ("bf16-moments", torch.float32, dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)),
    ("fp8-moments", torch.float32, dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8)),
    ("bf16-fp32-mixed", torch.float32, dict(exp_avg_dtype=torch.bfloat16)),
    ("fp8-fp16-mixed", torch.float32, dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=torch.float16)),
    ("bf16-params-fp32-master", torch.bfloat16, dict(master_weights=True)),
    (
        "bf16-params-bf16-moments-fp32-master",
        torch.bfloat16,
        dict(master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    ),
    (
        "bf16-params-fp16-master-fp16-fp8-moments",
        torch.bfloat16,
        dict(
            master_weights=True,
            master_weight_dtype=torch.float16,
            exp_avg_dtype=torch.float16,
            exp_avg_sq_dtype=FP8,
        ),
    ),
    (
        "bf16-params-remainders-bf16-moments",
        torch.bfloat16,
        dict(
            master_weights=True,
            store_param_remainders=True,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
        ),
    ),
    ("bf16-params-remainders", torch.bfloat16, dict(master_weights=True, store_param_remainders=True)),
    ("capturable-fp32", torch.float32, dict(capturable=True)),
    (
        "capturable-bf16-moments-fp32-master",
        torch.bfloat16,
        dict(capturable=True, master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    ),
    ("fp16-params-fp32-master", torch.float16, dict(master_weights=True, exp_avg_dtype=torch.float16)),
    (
        "fp16-params-fp16-master-fp8-bf16",
        torch.float16,
        dict(
            master_weights=True, master_weight_dtype=torch.float16, exp_avg_dtype=FP8, exp_avg_sq_dtype=torch.bfloat16
        ),
    ),
    ("l2-mode-fp16-moments", torch.float32, dict(adam_w_mode=False, exp_avg_dtype=torch.float16)),
]

SHAPES = [(8, 5), (5,), (3, 4, 2), (33,)]


def make_params(dtype: torch.dtype, seed: int = 0, shapes=SHAPES, device="cpu") -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype)) for s in shapes]


def clone_params(params) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def grads_for(step: int, shapes, dtype: torch.dtype, seed: int = 1234) -> list[torch.Tensor]:
    """Deterministic full (global) gradients for one step, identical on every rank and world size."""
    gen = torch.Generator().manual_seed(seed + 7919 * step)
    return [(torch.randn(s, generator=gen) * (0.5 + 0.25 * (step % 3))).to(dtype) for s in shapes]


def set_grads(params, step: int, seed: int = 1234, skip: set[int] | None = None) -> None:
    for i, (p, g) in enumerate(zip(params, grads_for(step, [p.shape for p in params], p_dtype(params), seed))):
        if skip and i in skip:
            p.grad = None
        elif isinstance(p, DTensor):
            from torch.distributed.tensor import distribute_tensor

            p.grad = distribute_tensor(g.to(p.device), p.device_mesh, p.placements)
        else:
            p.grad = g.to(p.device)


def p_dtype(params) -> torch.dtype:
    return params[0].dtype


def run_steps(opt, params, start: int, n: int, **kw) -> None:
    for s in range(start, start + n):
        set_grads(params, s, **kw)
        opt.step()
        opt.zero_grad()


def local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def raw(t):
    """The storage-carrying tensor: the local shard, and for TE's Float8Tensor its uint8 ``_data``."""
    t = local(t)
    data = getattr(t, "_data", None)
    return data if isinstance(data, torch.Tensor) and type(t) is not torch.Tensor else t


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits, for bitwise comparison (NaNs included)."""
    t = raw(t).detach().contiguous()
    if t.dtype in (torch.float32, torch.int32):
        return t.view(torch.int32)
    if t.dtype in (torch.float16, torch.bfloat16, torch.int16):
        return t.view(torch.int16)
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.view(torch.int64)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert raw(a).dtype == raw(b).dtype, f"{what}: dtype {raw(a).dtype} != {raw(b).dtype}"
    assert raw(a).shape == raw(b).shape, f"{what}: shape {raw(a).shape} != {raw(b).shape}"
    assert torch.equal(bits(a).cpu(), bits(b).cpu()), f"{what}: values differ"


def assert_flat_bitwise(actual: dict, expected: dict) -> None:
    """Two flat dictionaries (a key per tensor or value) with the same keys, tensors bitwise, values equal."""
    assert actual.keys() == expected.keys(), sorted(actual.keys() ^ expected.keys())
    for key, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert isinstance(actual[key], torch.Tensor), key
            assert_bitwise(actual[key], want, key)
        else:
            assert actual[key] == want, f"{key}: {actual[key]!r} != {want!r}"


def assert_state_dicts_bitwise(a: dict, b: dict, what: str = "") -> None:
    assert a["state"].keys() == b["state"].keys(), what
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys(), f"{what} state {k}"
        for name, va in a["state"][k].items():
            vb = b["state"][k][name]
            assert type(va) is type(vb), f"{what} {k}.{name}: {type(va)} vs {type(vb)}"
            if isinstance(va, DTensor):
                assert va.placements == vb.placements and va.device_mesh == vb.device_mesh
                assert va.shape == vb.shape and va.stride() == vb.stride()
            assert_bitwise(va, vb, f"{what} {k}.{name}")
    assert len(a["param_groups"]) == len(b["param_groups"])
    for ga, gb in zip(a["param_groups"], b["param_groups"]):
        assert ga.keys() == gb.keys()
        for key in ga:
            va, vb = ga[key], gb[key]
            if isinstance(va, torch.Tensor):
                assert torch.equal(va.cpu(), vb.cpu()), f"{what} group {key}"
            else:
                assert va == vb, f"{what} group {key}: {va} != {vb}"


def deep_clone(sd: dict) -> dict:
    """A copy of an exported state dict that shares no tensor storage with it."""
    out = copy.copy(sd)
    out["state"] = {
        k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in d.items()} for k, d in sd["state"].items()
    }
    out["param_groups"] = copy.deepcopy(sd["param_groups"])
    return out


@dataclass
class LiveSnapshot:
    """Values, devices and storage pointers of an optimizer's live state and param_groups."""

    values: dict = field(default_factory=dict)
    ptrs: dict = field(default_factory=dict)
    devices: dict = field(default_factory=dict)
    groups: list = field(default_factory=list)

    @classmethod
    def take(cls, opt) -> LiveSnapshot:
        snap = cls()
        for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
            for name, v in opt.state[p].items():
                snap.values[(i, name)] = bits(v).clone()
                snap.ptrs[(i, name)] = raw(v).data_ptr()
                snap.devices[(i, name)] = raw(v).device
        for g in opt.param_groups:
            entry = {}
            for k, v in g.items():
                if k == "params":
                    entry[k] = [id(p) for p in v]
                elif isinstance(v, torch.Tensor):
                    entry[k] = ("tensor", id(v), v.device, v.detach().clone())
                else:
                    entry[k] = copy.deepcopy(v)
            snap.groups.append(entry)
        return snap

    def assert_same(self, other: LiveSnapshot) -> None:
        assert self.ptrs == other.ptrs, "live state storage moved"
        assert self.devices == other.devices, "live state device changed"
        assert self.values.keys() == other.values.keys()
        for k in self.values:
            assert torch.equal(self.values[k], other.values[k]), f"live state {k} changed"
        assert len(self.groups) == len(other.groups)
        for a, b in zip(self.groups, other.groups):
            assert a.keys() == b.keys()
            for k in a:
                if isinstance(a[k], tuple) and a[k][0] == "tensor":
                    assert a[k][1] == b[k][1], f"param_groups {k} object replaced"
                    assert a[k][2] == b[k][2], f"param_groups {k} device changed"
                    assert torch.equal(a[k][3], b[k][3]), f"param_groups {k} value changed"
                else:
                    assert a[k] == b[k], f"param_groups {k} changed"


DROP_IN = Path(__file__).resolve().parent.parent / "docs" / "drop-in.md"


def drop_in_block(name: str) -> str:
    """The fenced block that follows ``<!-- drop-in:<name> -->`` in docs/drop-in.md (the tests run them as written)."""
    match = re.search(rf"<!-- drop-in:{name} -->\n```\w+\n(.*?)```", DROP_IN.read_text(), re.S)
    assert match, f"docs/drop-in.md has no block {name}"
    return match.group(1)


def record_exports(optimizer) -> list[tuple[list[torch.Tensor], bool]]:
    """Per ``state_dict()`` of ``optimizer`` from now on (a post-hook): the pooled export buffers it holds that are
    not given back yet (local tensors, held here, so that their ids stay theirs), and whether the export was
    deferred (not waited for when ``state_dict()`` returned)."""
    from optim_factory.optimizers.export import local_tensor
    from optim_factory.tree import leaves

    exports = []

    def record(opt, state_dict):
        tensors = [local_tensor(t) for _, t in leaves(state_dict) if isinstance(t, torch.Tensor)]
        exports.append(([t for t in tensors if opt.is_leased_export_buffer(t)], opt.state_dict_pending))

    optimizer.register_state_dict_post_hook(record)
    return exports


def same_export_buffers(exports: list[tuple[list[torch.Tensor], bool]]) -> bool:
    """Whether every export of :func:`record_exports` held the same buffers (some)."""
    first = {id(t) for t in exports[0][0]}
    return bool(first) and all({id(t) for t in buffers} == first for buffers, _ in exports)
