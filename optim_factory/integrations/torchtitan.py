"""torchtitan 0.3 integration: optim-factory's ``FusedAdam`` and ``PortableFusedAdam`` in torchtitan's optimizer config.

torchtitan builds its optimizers through ``OptimizersContainer.Config``: a list of ``ParamGroupConfig`` (a regex,
an optimizer name, the group's keyword arguments) plus ``optimizer_factory_kwargs_by_name`` (arguments passed once
to each optimizer's constructor). Its container resolves names from a fixed table (``Adam``, ``AdamW``,
``DistMuon``), so this module ships a container that also knows ``FusedAdam`` and ``PortableFusedAdam``, and two
ways to select it:

- in a config_registry function, in place of ``default_adamw(lr=...)``::

      optimizer=fused_adam(lr=8e-4, exp_avg_dtype="bf16", master_weights=True),

- without editing any config, torchtitan's override mechanism swaps every ``AdamW`` group::

      --override.imports optim_factory.integrations.torchtitan.use_fused_adam

  with options as a JSON object: ``'optim_factory.integrations.torchtitan.use_fused_adam={"exp_avg_dtype": "bf16"}'``.

Both split the options as torchtitan expects: the per-group hyperparameters (``lr``, ``betas``, ``eps``,
``weight_decay``, ``bias_correction``) go into the groups' ``optimizer_kwargs``, every other option (``master_weights``,
``exp_avg_dtype``, ``state_dict_cpu_offload`` ...) into ``optimizer_factory_kwargs_by_name``, because our classes take
optimizer-wide options from their constructor only. The ``fused`` / ``foreach`` / ``param_names`` keys torchtitan adds
to each group stay in the groups; our classes keep them and ignore them.

Checkpoints go through torchtitan's own path (``OptimizersContainer.state_dict`` -> the optimizer's
``state_dict()``), so ``state_dict_cpu_offload`` makes the export CPU-side, and ``CheckpointManager`` saves and
reshards it with DCP like any optimizer's. This module's ``CheckpointManager`` is torchtitan's with one change: it
loads through :class:`optim_factory.checkpoint.ExactLoadPlanner`, so a checkpoint whose master or moments were
saved in another format (int16 remainders and an FP32 master, with master weights turned on or off) converts
exactly (torchtitan's own reads each state into the template's dtype), and through
:class:`optim_factory.checkpoint.SafeFileSystemReader`, so nothing in a checkpoint runs as code. Select it in a
config_registry function::

      checkpoint=CheckpointManager.Config(enable=True, folder="checkpoint", ...),

Its async modes save through :class:`optim_factory.checkpoint.AsyncSaveStager`, built once (on torchtitan's
gloo group of async saves) and closed when torchtitan closes the manager: the optimizers' pooled export buffers
(``state_dict_offload_reuse_buffers``) go to DCP's writer uncopied and back to the optimizer once written, the
model's CUDA tensors into pinned host copies kept from save to save in ``async_with_pinned_mem`` (fresh copies in
``async``), and a refused save (a failed or stuck export) raises from ``maybe_wait_for_saving`` in one line with
nothing written.
The stager's ``async_save`` exports the states with a background export (``state_dict_offload_background``)
deferred, in both modes. ``async_with_pinned_mem`` keeps torchtitan's contract, staging beside training until
``maybe_wait_for_staging`` (torchtitan's Trainer calls it before the optimizer step), so there the export fills
beside the next forward and backward. ``async`` keeps torchtitan's too, staged when the save returns: the save
waits for the export to fill before it returns.
``CheckpointManager.Config(write_in_process=True)`` writes the async saves in a writer process of each rank's own
(``StagerOptions(write_in_process=True)``), as torchtitan's own ``async_with_pinned_mem`` writes in DCP's process
executor. An optimizer with ``state_dict_offload_host_budget`` saves within it in every mode (a sync save through
the stager, waited for): the stager fills each state as DCP's writer reaches it (``optim_factory.checkpoint``).

Importing this module imports torchtitan; the rest of optim_factory never does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import optim_factory
from optim_factory.checkpoint import (
    AsyncSaveStager,
    ExactLoadPlanner,
    SafeFileSystemReader,
    StagerOptions,
    host_budget,
)
from optim_factory.integrations import framework_import_error

try:  # names torchtitan 0.3 and its main branch both provide (0.3's components.checkpoint is main's checkpointer)
    from torchtitan.components.checkpointer import MODEL, OPTIMIZER, AsyncMode
    from torchtitan.components.checkpointer import CheckpointManager as TitanCheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer as TitanOptimizersContainer
    from torchtitan.components.optimizer import ParamGroupConfig
    from torchtitan.config import derive, override
    from torchtitan.tools.logging import logger as titan_logger
except ImportError as exc:
    raise framework_import_error("torchtitan", exc) from exc
from optim_factory.rules.groups import GROUP_KEYS

__all__ = [
    "OPTIMIZER_NAMES",
    "GROUP_OPTIONS",
    "CheckpointManager",
    "OptimizersContainer",
    "fused_adam",
    "split_options",
    "use_fused_adam",
]

OPTIMIZER_NAMES = ("FusedAdam", "PortableFusedAdam")
"""The ``optimizer_name`` values this container adds to torchtitan's table (the classes of ``optim_factory``)."""

GROUP_OPTIONS = tuple(k for k in GROUP_KEYS if k not in ("params", "param_names", "step"))
"""The options our classes take per param group; every other option is the constructor's."""


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split options into (``ParamGroupConfig.optimizer_kwargs``, ``optimizer_factory_kwargs_by_name`` entry)."""
    group = {k: v for k, v in options.items() if k in GROUP_OPTIONS}
    return group, {k: v for k, v in options.items() if k not in GROUP_OPTIONS}


def _check_name(name: str) -> None:
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"optimizer name {name!r}: expected one of {', '.join(OPTIMIZER_NAMES)}")


class OptimizersContainer(TitanOptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also resolves ``FusedAdam`` and ``PortableFusedAdam``.

    Everything else (param groups by regex, one optimizer per model part and name, the FQN-keyed flat state dict
    that ``CheckpointManager`` saves) is torchtitan's. Its own names (``AdamW`` ...) still resolve, so groups of
    both kinds can share one config.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(TitanOptimizersContainer.Config):
        """torchtitan's optimizer config, unchanged; declared here so that ``config.build()`` builds this class."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        ours = sorted({pg.optimizer_name for pg in config.param_groups} & set(OPTIMIZER_NAMES))
        if config.implementation == "fused_opt_states_bf16" and ours:  # torchtitan's hook: torch's Adam/AdamW only
            raise ValueError(
                f"optimizer.implementation=fused_opt_states_bf16 has no effect on {', '.join(ours)}: set "
                "exp_avg_dtype=bf16 and exp_avg_sq_dtype=bf16 (optimizer_factory_kwargs_by_name) instead"
            )
        super().__init__(config, model_parts=model_parts)

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        # torchtitan's only hook for a name -> class table (a private static method, called from __init__).
        if name in OPTIMIZER_NAMES:
            return getattr(optim_factory, name)  # FusedAdam is imported lazily: TE only when it is used
        return TitanOptimizersContainer._resolve_optimizer_factory(name)


class OncePerProcess(logging.Filter):
    """A filter that lets each message through once per process, for the records logged inside :meth:`apply`."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger, self.said = logger, set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.said:
            return False
        self.said.add(message)
        return True

    def apply(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` with this filter on the logger."""
        self.logger.addFilter(self)
        try:
            return call(*args)
        finally:
            self.logger.removeFilter(self)


TITAN_CHECK_WARNINGS = OncePerProcess(titan_logger)  # torchtitan logs on the root logger


class CheckpointManager(TitanCheckpointManager):
    """torchtitan's ``CheckpointManager`` whose DCP loads read the optimizer's states in their saved dtypes
    (:class:`~optim_factory.checkpoint.ExactLoadPlanner`): our classes convert a changed master format exactly,
    any other optimizer loads as it does with torchtitan's. Its async modes save through an
    :class:`~optim_factory.checkpoint.AsyncSaveStager` kept in ``stager`` (the module docstring). Sync saves, HF
    loads and saves, retention: torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanCheckpointManager.Config):
        """torchtitan's checkpoint config and ``write_in_process``; declared here so that ``config.build()`` builds
        this class.

        The warnings of torchtitan's checks (``initial_load_model_only=True has no effect without an
        initial_load_path.``, on its default values) are logged once per process: ``build()`` copies the config
        (``dataclasses.replace``), which runs the checks again, so each config built would say each one twice."""

        write_in_process: bool = False
        """Our async saves written by a writer process of each rank's own, as torchtitan's ``async_with_pinned_mem``
        writes in DCP's process executor (``StagerOptions(write_in_process=True)``, docs/export.md)."""

        def __post_init__(self) -> None:
            TITAN_CHECK_WARNINGS.apply(TitanCheckpointManager.Config.__post_init__, self)  # (slots: no bare super())
            if self.write_in_process and self.async_mode == AsyncMode.DISABLED:  # lowered by torchtitan's check
                raise ValueError(
                    "CheckpointManager.Config(write_in_process=True): writes async saves; set async_mode='async' or "
                    "'async_with_pinned_mem'"
                )

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.budgeted = any(host_budget(opt) is not None for opt in kwargs["optimizers"].optimizers)
        if self.enable and (self.async_mode != AsyncMode.DISABLED or self.budgeted):
            # torchtitan's own slot for its stager, which its close() closes; its gloo group of async saves (every
            # rank made it in the constructor above) carries the ranks' agreement on a refusal
            pinned = self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
            options = StagerOptions(pinned=pinned, write_in_process=config.write_in_process)
            self.stager = AsyncSaveStager(kwargs["optimizers"].optimizers, options, process_group=self.pg)

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        budgeted = self.budgeted and OPTIMIZER in state_dict  # a sync save within the budget: the stager's, waited
        if (async_mode == AsyncMode.DISABLED and not budgeted) or to_hf:  # torchtitan saves HF files sync only
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if async_mode == AsyncMode.DISABLED:  # written when it returns, nothing copied
            self.stager.save(state_dict, checkpoint_id=checkpoint_id, process_group=self.pg)
            return None
        # the states' export inside: a background one returns unfilled, filled while the caller goes on
        response = self.stager.async_save(state_dict, checkpoint_id=checkpoint_id, process_group=self.pg)
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:  # the caller waits before the next step
            return response  # torchtitan keeps both completions: maybe_wait_for_staging, maybe_wait_for_saving
        response.staging_completion.result()  # "async": staged when the save returns, as with torchtitan's stager
        return response.upload_completion

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:  # safetensors of the model: no optimizer state
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        # read as data (nothing in the checkpoint runs); the optimizer's states in their saved dtypes
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(checkpoint_id), planner=ExactLoadPlanner())
        if MODEL in self.states:  # torchtitan flattens the model's states into state_dict and loads them itself
            self.states[MODEL].load_state_dict(state_dict)


def fused_adam(
    lr: float = 8e-4,
    *,
    name: str = "FusedAdam",
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    **options: Any,
) -> OptimizersContainer.Config:
    """A catch-all param group of ``name`` (``FusedAdam`` or ``PortableFusedAdam``): our ``default_adamw``.

    Same defaults as torchtitan's ``default_adamw``; ``options`` are any other constructor options of ours
    (``master_weights=True``, ``exp_avg_dtype="bf16"``, ``state_dict_cpu_offload=True`` ...), routed by
    ``split_options``.
    """
    _check_name(name)
    group, factory = split_options({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **options})
    return OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=group)],
        optimizer_factory_kwargs_by_name={name: factory},
    )


@override(target=TitanOptimizersContainer.Config, description="optim-factory FusedAdam for AdamW groups")
def use_fused_adam(config: TitanOptimizersContainer.Config, *, name: str = "FusedAdam", **options: Any):
    """Swap every ``AdamW`` group of an optimizer config for ``name``, keeping its patterns and hyperparameters.

    ``options`` set per-group hyperparameters (for the swapped groups) and constructor options, as in
    ``fused_adam``. ``Adam`` groups (L2 weight decay, not decoupled) and other optimizers stay as they are.
    """
    _check_name(name)
    group, factory = split_options(options)
    swapped = [
        replace(pg, optimizer_name=name, optimizer_kwargs={**pg.optimizer_kwargs, **group})
        if pg.optimizer_name == "AdamW"
        else pg
        for pg in config.param_groups
    ]
    if not any(pg.optimizer_name == "AdamW" for pg in config.param_groups):
        raise ValueError(f"use_fused_adam: no AdamW param group to swap for {name}")
    by_name = dict(config.optimizer_factory_kwargs_by_name)
    by_name[name] = {**by_name.get(name, {}), **factory}
    return derive(config, OptimizersContainer.Config, param_groups=swapped, optimizer_factory_kwargs_by_name=by_name)
