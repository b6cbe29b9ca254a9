"""The saved and the live format of a master weight, and the exact conversion between them (docs/export.md,
"Loading another format").

A checkpoint's ``master_param`` is one of: absent (saved without master weights), an FP32 tensor (an FP32 master,
or an FP16 master exported as FP32: TE's ``state_dict()`` exports every state as FP32) or int16 remainders (the
low 16 bits of the FP32 master of a BF16 parameter, whose high bits are the parameter). The optimizer stores one
of: nothing (``master_weights=False``), an FP32 or FP16 master, or int16 remainders. Moments need no rule here:
they are exported as FP32 (BF16 with ``state_dict_keep_bf16``) and any of those converts exactly into any stored
moment dtype by ``set_scaled_state``.

Three conversions need the parameter, and the parameter must be the one loaded from the same checkpoint:

* ``join``: int16 remainders saved, a full master wanted: the FP32 master is the parameter's bits joined with them;
* ``split``: a full master saved, remainders wanted: the parameter becomes the master rounded as the remainder
  kernels round (which differs from a plain BF16 rounding at ties) and the remainders its low bits, so that the two
  rejoin the saved master exactly;
* ``from_param``: no master saved, master weights on: the master starts as the parameter, exactly.

DCP's ``set_state_dict`` loads the optimizer before the model, and torchtitan's ``CheckpointManager`` does too, so
the parameter a load sees may not be loaded yet. :func:`load_master` therefore applies a conversion with the
parameter it sees and returns it; our optimizers apply it again, with the loaded parameter, before the next
``step()`` or ``state_dict()`` (:meth:`MasterConversion.apply`), whatever order a framework loads in.

DCP's default planner reads each saved tensor into the template's dtype, so without
:class:`~optim_factory.checkpoint.ExactLoadPlanner` a changed master format arrives cast: int16 remainders in an
FP32 master's template as whole numbers within int16's range, an FP32 master in int16 remainders' template
truncated to whole numbers (0 for every weight below 1). The checkpoint's own dtype is not in what the optimizer
receives, and a key of our own in the template would make DCP refuse every checkpoint without it (TE's class's,
and ours written without it), so :func:`check_not_cast` tells these from the values, over every master of the dictionary
at once, and refuses them before anything is loaded. Moments need no such check: their templates are FP32 or BF16
(the stored dtype with ``state_dict_keep_bf16``), and DCP's cast into BF16 rounds as ``set_scaled_state`` does.

A master of an FP32 parameter is never used by an update (the parameter is its own master) but is kept, loaded
and exported, as TE's class keeps it: a checkpoint's keys are the same before and after any number of resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from optim_factory.optimizers.export.tensors import (
    aliases,
    all_per_device,
    join_bf16_remainder,
    local_tensor,
    split_bf16_remainder,
)

__all__ = [
    "MASTER",
    "LOAD_FIX",
    "MasterConversion",
    "check_not_cast",
    "fp32_own",
    "load_master",
    "saved_format",
    "live_format",
    "wants_remainders",
]

LOAD_FIX = (
    "read it with dcp.load(..., planner=ExactLoadPlanner()) (optim_factory.checkpoint), or through "
    "optim_factory.integrations' torchtitan CheckpointManager or Automodel Checkpointer"
)
"""What a load of a changed master format through DCP's default planner needs instead (docs/export.md)."""

# every remainder a cast FP32 master leaves is within this bound (the whole part of a weight below 256); real
# remainders of a trained run span int16's range: all of them within it, in more than a few elements, do not occur
_TRUNCATED = 256

MASTER = "master_param"


def wants_remainders(optimizer: Any, param: torch.Tensor) -> bool:
    """Whether ``optimizer`` stores ``param``'s master as int16 remainders."""
    return bool(optimizer.master_weights and optimizer.store_param_remainders and param.dtype == torch.bfloat16)


def live_format(optimizer: Any, param: torch.Tensor) -> str:
    """How ``optimizer`` stores ``param``'s master, in words."""
    if not optimizer.master_weights:
        return "no master (master_weights=False)"
    if wants_remainders(optimizer, param):
        return "int16 remainders"
    dtype = optimizer.name_to_dtype_map[MASTER]
    return f"an {'FP16' if dtype == torch.float16 else 'FP32'} master"


def saved_format(value: torch.Tensor | None) -> str:
    """What a checkpoint's ``master_param`` holds, in words."""
    if value is None:
        return "no master"
    if value.dtype == torch.int16:
        return "int16 remainders"
    return f"a {str(value.dtype).removeprefix('torch.')} master"


@dataclass(frozen=True, eq=False)
class MasterConversion:
    """A loaded master that depends on its parameter (``kind``: ``join``, ``split`` or ``from_param``, see the
    module docstring), with a host copy of the saved local tensor it converts (its own: the caller's dictionary may
    alias live state; moved to the parameter's device only while it is applied; ``None`` for ``from_param``)."""

    param: torch.Tensor
    kind: str
    saved: torch.Tensor | None

    @torch.no_grad()
    def apply(self, optimizer: Any) -> None:
        """Store the master from the parameter as it is now (``split`` also writes the parameter)."""
        local = local_tensor(self.param)
        saved = None if self.saved is None else self.saved.to(local.device)
        if self.kind == "join":
            optimizer.set_scaled_state(self.param, MASTER, join_bf16_remainder(local, saved))
        elif self.kind == "split":
            remainders = torch.empty(local.shape, dtype=torch.int16, device=local.device)
            split_bf16_remainder(saved.float(), local, remainders)
            optimizer.set_scaled_state(self.param, MASTER, remainders)
        else:  # from_param (a full master: remainders of a master from the parameter are zeros, never pending)
            optimizer.set_scaled_state(self.param, MASTER, local.detach().float())


def fp32_own(saved: torch.Tensor) -> torch.Tensor:
    """A saved state's local tensor as FP32, never aliasing ``saved`` (``set_scaled_state`` may scale its argument
    in place): what ``set_scaled_state`` takes for every state but int16 remainders."""
    value = local_tensor(saved).float()
    return value.clone() if aliases(value, saved) else value


def load_master(optimizer: Any, param: torch.Tensor, saved: torch.Tensor | None) -> MasterConversion | None:
    """Store a checkpoint's master of ``param`` (``saved``: a plain or DTensor, any device; ``None`` when the
    checkpoint has none) in the optimizer's format; return the conversion to apply again once the parameter is
    loaded, or ``None`` when the stored master does not depend on it. Without master weights nothing is stored:
    the parameter, loaded with the model, is the weight."""
    if not optimizer.master_weights:
        return None
    value = None if saved is None else local_tensor(saved)
    remainders = wants_remainders(optimizer, param)
    if value is None and remainders:  # zero remainders: the parameter is the master, whatever it holds
        optimizer.set_scaled_state(param, MASTER, torch.zeros_like(local_tensor(param), dtype=torch.int16))
        return None
    if value is None:
        conversion = MasterConversion(param, "from_param", None)
    elif (value.dtype == torch.int16) != remainders:  # join, or split: 2 or 4 bytes per element until applied
        conversion = MasterConversion(param, "split" if remainders else "join", value.detach().to("cpu", copy=True))
    else:
        optimizer.set_scaled_state(param, MASTER, value if value.dtype == torch.int16 else fp32_own(saved))
        return None
    conversion.apply(optimizer)
    return conversion


def check_not_cast(optimizer: Any, masters: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Refuse, in one ``ValueError`` line, a dictionary whose masters DCP's default planner has cast into another
    format; ``masters``: (where, parameter, local tensor) of every ``master_param`` a load is given.

    Over all the masters of BF16 parameters at once (one sync per device), with master weights on:

    * stored as a full master, every received FP32 master holds only whole numbers within int16's range: int16
      remainders read into an FP32 template (a trained master has fractions);
    * stored as int16 remainders, every received remainder is within +-255: an FP32 master truncated into an int16
      template (a trained run's remainders span int16's range; a run whose masters never left their BF16
      parameters, all remainders 0, is refused too: the two cannot be told apart).

    A dictionary read in the saved dtypes (``ExactLoadPlanner``, ``torch.load``) holds int16 remainders as int16 and
    a full master as FP32 with fractions, and passes. A rank decides from its own shards."""
    if not optimizer.master_weights:
        return
    bf16 = [(where, p, t) for where, p, t in masters if p.dtype == torch.bfloat16 and t.numel()]
    full = [(w, p, t) for w, p, t in bf16 if not wants_remainders(optimizer, p) and t.dtype == torch.float32]
    if full and all_per_device(
        (t for *_, t in full), lambda t: [(t == t.trunc()).all() & (t.abs().amax() <= 32768)], lambda v: v
    ):
        raise ValueError(
            f"load_state_dict: {full[0][0]}: every master holds only whole numbers within int16's range, as int16 "
            f"remainders read into an FP32 master by DCP's default planner do; saved: int16 remainders, stored "
            f"here: {live_format(optimizer, full[0][1])}; not loaded: {LOAD_FIX}"
        )
    kept = [(w, t) for w, p, t in bf16 if wants_remainders(optimizer, p) and t.dtype == torch.int16]
    if kept and all_per_device(
        (t for _, t in kept), lambda t: list(torch.aminmax(t)), lambda v: (v > -_TRUNCATED) & (v < _TRUNCATED)
    ):
        raise ValueError(
            f"load_state_dict: {kept[0][0]}: every int16 remainder is within +-{_TRUNCATED - 1}, as an FP32 master "
            f"truncated into int16 remainders by DCP's default planner is; saved: an FP32 master, stored here: "
            f"int16 remainders; not loaded: {LOAD_FIX}"
        )
