"""NeMo Automodel 0.7 integration: its ``Checkpointer``, loading the optimizer through
:class:`optim_factory.checkpoint.ExactLoadPlanner`.

Automodel's ``Checkpointer.load_optimizer`` reads ``<weights_path>/optim`` with DCP's default planner, which copies
each saved tensor into the template's dtype: a checkpoint saved with int16 remainders and resumed with an FP32
master (or the reverse) loads cast bytes, silently. This ``Checkpointer`` is Automodel's with that read made exact::

    from optim_factory.integrations.automodel import Checkpointer

    checkpointer = Checkpointer(config, dp_rank, tp_rank, pp_rank)  # Automodel's arguments, unchanged
    checkpointer.load_optimizer(optimizer, model, weights_path)

Everything else (saving, async saves, the model's HF and PEFT formats, MSC paths) is Automodel's. Importing this
module imports Automodel's checkpoint package (and transformers); the rest of optim_factory never does.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp

from optim_factory.checkpoint import ExactLoadPlanner
from optim_factory.integrations import framework_import_error

try:
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer as AutomodelCheckpointer
except ImportError as exc:
    raise framework_import_error("nemo-automodel", exc) from exc

__all__ = ["Checkpointer"]

OPTIM_DIR = "optim"
"""The folder of a checkpoint step that ``Checkpointer.load_optimizer`` reads (Automodel's layout)."""


class Checkpointer(AutomodelCheckpointer):
    """Automodel's ``Checkpointer``; the optimizer's states are read in their saved dtypes (through the caller's
    storage reader where ``_do_load`` is given one), so that our classes convert a changed master format exactly
    (any other optimizer loads as with Automodel's)."""

    def _do_load(self, state_dict: dict[str, Any], path: str, storage_reader=None, is_init_step: bool = False):
        # Automodel's one DCP read, for the model and the optimizer; only the optimizer's folder is changed: read
        # through the caller's storage reader where one is given (any path), else from a local folder
        local = "://" not in str(path)
        optimizer = os.path.basename(os.path.normpath(path)) == OPTIM_DIR
        if not optimizer or (storage_reader is None and not local):
            return super()._do_load(state_dict, path, storage_reader, is_init_step)
        group = getattr(self, "process_group", None)
        dcp.load(
            state_dict,
            checkpoint_id=path,
            storage_reader=storage_reader,
            planner=ExactLoadPlanner(),
            **({"process_group": group} if group is not None else {}),
        )
        return state_dict
