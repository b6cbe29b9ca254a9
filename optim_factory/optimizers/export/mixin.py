"""``OffloadedStateDict``: the ``state_dict`` family shared by both FusedAdam backends. See docs/design.md,
"Optimizer API".
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from operator import attrgetter
from typing import Any, TypeVar

import torch

from optim_factory.optimizers.export.contract import load_exported_state, param_index_map
from optim_factory.optimizers.export.formats import MasterConversion, wants_remainders
from optim_factory.optimizers.export.options import OPTION_NAMES, ExportOptions
from optim_factory.optimizers.export.plan import ExportPlan
from optim_factory.optimizers.export.stream import StateExporter
from optim_factory.optimizers.export.tensors import local_tensor

__all__ = ["OffloadedStateDict"]

_Class = TypeVar("_Class", bound=type)


def _option_attributes(cls: _Class) -> _Class:
    """Give ``cls`` one read-only attribute per export option, by the name users spell it
    (``opt.state_dict_cpu_offload`` is ``opt.export_options.cpu_offload``; :data:`OPTION_NAMES`)."""
    for option, name in OPTION_NAMES.items():
        setattr(cls, option, property(attrgetter(f"_export_options.{name}"), doc=f"``export_options.{name}``"))
    return cls


@_option_attributes
class OffloadedStateDict:
    """``state_dict`` / ``wait_state_dict`` / ``load_state_dict`` / ``release_state_dict`` /
    ``prepare_state_dict`` of both backends.

    The optimizer calls :meth:`_init_export` in its ``__init__`` with its :class:`ExportOptions`; it then owns
    them (:attr:`export_options`, frozen) and one :class:`StateExporter` (the pool of reusable host buffers, the
    export's threads). Each export is an :class:`ExportPlan` of the whole options and that exporter. The options'
    constructor names are readable as attributes (``opt.state_dict_cpu_offload`` ...), not writable.
    """

    _export_options: ExportOptions
    _exporter: StateExporter
    _deferring: int  # > 0 inside deferred_state_dict()
    _loaded_masters: list[MasterConversion]  # a load's masters that depend on the parameters (settle_masters)

    def _init_export(self, options: ExportOptions) -> None:
        self._export_options = options
        self._exporter = StateExporter()
        self._deferring = 0
        self._unfilled: list | None = None  # inside unfilled_state_dict(): the streamed states' items
        self._loaded_masters = []

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickle copy: every attribute (torch's ``Optimizer.__getstate__`` keeps only
        ``defaults``, ``state`` and ``param_groups``: a copy would have neither its options nor its exporter, and its
        first ``step()`` or ``state_dict()`` would raise ``AttributeError``) but the exporter (threads, pinned host
        buffers) and torch's hooks (which torch does not copy either); :meth:`__setstate__` gives the copy its own
        exporter."""
        return {
            k: v
            for k, v in self.__dict__.items()
            if k != "_exporter" and not (k.startswith("_optimizer_") and k.endswith("_hooks"))
        } | {"_deferring": 0, "_unfilled": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        torch.optim.Optimizer.__setstate__(self, state)
        self._exporter = StateExporter()
        self._start_export_threads()

    def _warn_without_gpu(self) -> None:
        """``state_dict_cpu_offload`` saves GPU memory; with no parameter on the GPU this machine has there is none
        to save: a warning at the constructor's caller (Python says it once per calling line and process). A
        machine without a GPU says nothing: there the option runs code meant for a GPU on the CPU, as the
        README's examples do. The optimizer calls this at the end of ``__init__``."""
        params = [p for g in self.param_groups for p in g["params"]]
        if not (self._export_options.cpu_offload and params and torch.cuda.is_available()):
            return
        if not any(local_tensor(p).is_cuda for p in params):
            warnings.warn(
                "state_dict_cpu_offload=True has no memory effect here: the parameters are not on a GPU",
                UserWarning,
                stacklevel=3,
            )

    def _start_export_threads(self) -> None:
        """Get the exporter's threads ready for the options' exports (:meth:`ExportPlan.start_threads`); the
        optimizer calls this at the end of ``__init__``, a copy in ``__setstate__``."""
        devices = {p.device for g in self.param_groups for p in g["params"]}
        self._plan().start_threads(devices)

    def _plan(self) -> ExportPlan:
        """The plan of an export with the optimizer's options and exporter."""
        return ExportPlan(self._export_options, self._exporter)

    # ------------------------------------------------------------------ options
    @property
    def export_options(self) -> ExportOptions:
        """The export options (frozen)."""
        return self._export_options

    @property
    def state_exporter(self) -> StateExporter:
        """The optimizer's exporter and its buffer pool (``state_exporter.pool``)."""
        return self._exporter

    # ------------------------------------------------------------------ export and load
    def _on_device_state_dict(self) -> dict[str, Any]:
        """The export with offload off (TE's own ``state_dict()``)."""
        return ExportPlan(ExportOptions()).export(self)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict, exported as the options say (see :class:`ExportPlan`).

        With ``state_dict_offload_background``, inside :meth:`deferred_state_dict` it returns once the host
        tensors are allocated, before they hold their values: the caller calls :meth:`wait_state_dict` before
        reading them (``step()`` and ``load_state_dict()`` wait too). Anywhere else it waits for them before it
        returns, so a plain reader (``torch.save``, ``dcp.save`` of ``get_optimizer_state_dict``) never reads
        unfilled tensors. A pending export is waited for first (its failure raises here).
        """
        self._wait_and_settle()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # type: ignore[attr-defined]
            pre_hook(self)
        o = self._export_options
        with self._torch_hooks_held():
            if not (o.cpu_offload or o.keep_bf16):
                exported = self._on_device_state_dict()
            else:
                exported = self._plan().export(self, self._unfilled)
        if o.background and not self._deferring:
            self.wait_state_dict()  # nobody asked to wait later: filled before anyone can read it
        for post_hook in self._optimizer_state_dict_post_hooks.values():  # type: ignore[attr-defined]
            result = post_hook(self, exported)
            if result is not None:
                exported = result
        return exported

    @contextlib.contextmanager
    def _torch_hooks_held(self) -> Iterator[None]:
        """torch's ``Optimizer.state_dict``/``load_state_dict``, which the export and the load call inside, without
        the optimizer's state-dict hooks: this class runs them itself around the whole operation, so that a
        post-hook sees (and may change) the exported dictionary, not the stored one, and a load pre-hook's
        dictionary is the one loaded (in torch's order, which TE keeps, post-hooks see scaled FP16 storage and their
        changes are overwritten, load pre-hooks see no states, and load post-hooks run before any state is set).
        The hook registries are torch's attributes of this optimizer, swapped for empty ones and put back."""
        names = (
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        )
        held = {name: self.__dict__[name] for name in names}
        try:
            for name in names:
                self.__dict__[name] = collections.OrderedDict()
            yield
        finally:
            self.__dict__.update(held)

    @contextlib.contextmanager
    def deferred_state_dict(self) -> Iterator[None]:
        """``with opt.deferred_state_dict(): sd = get_optimizer_state_dict(model, opt)``: a background export
        (``state_dict_offload_background``) started inside returns unfilled, so that the caller's next forward and
        backward overlap it; the caller promises to wait (:meth:`wait_state_dict`, or ``step()``) before reading
        the tensors. ``optim_factory.checkpoint.AsyncSaveStager`` does. Re-entrant."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1

    @contextlib.contextmanager
    def unfilled_state_dict(self) -> Iterator[list]:
        """``with opt.unfilled_state_dict() as items: sd = get_optimizer_state_dict(model, opt)``: a chunked export
        started inside returns a meta tensor in place of each streamed state (no memory; a reader that copies its
        data out fails, ``torch.save`` stores it without data) and appends each state's item to ``items``, for a
        caller that streams each into memory of its own just before writing it
        (``optim_factory.checkpoint.BudgetSavePlanner``)."""
        if self._unfilled is not None:
            raise RuntimeError("unfilled_state_dict: already inside one")
        self._unfilled = items = []
        try:
            yield items
        finally:
            self._unfilled = None

    def wait_state_dict(self, timeout: float | None = None) -> None:
        """Block until a background export (``state_dict_offload_background``) has filled its host tensors; re-raise
        its failure. The failure is raised once, by the first of this, ``step()``, ``load_state_dict()`` or
        ``state_dict()`` to wait (and by every other thread that was waiting for it meanwhile): a dictionary whose
        export failed holds garbage and must not be saved. Returns at once when nothing is pending. After
        ``timeout`` seconds without the export finishing it raises ``concurrent.futures.TimeoutError`` and the
        export stays pending."""
        self._exporter.wait(timeout)

    @property
    def state_dict_pending(self) -> bool:
        """Whether a background export has not been waited for yet (it may have finished already)."""
        return self._exporter.pending

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load CPU or GPU, plain or DTensor states, one state at a time (see :func:`load_exported_state`).
        A pending background export is waited for first (its failure raises here, nothing is loaded)."""
        self.wait_state_dict()
        if isinstance(state_dict, dict):  # as torch: a pre-hook may change the top level, not the caller's
            state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():  # type: ignore[attr-defined]
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        with self._torch_hooks_held():
            conversions = load_exported_state(self, state_dict)
        self._loaded_masters = conversions  # a failed load raised above and left the previous ones
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():  # type: ignore[attr-defined]
            post_hook(self)

    def _wait_and_settle(self) -> None:
        """What ``step()`` (both classes), ``state_dict()`` and ``initialize_states()`` do first: wait for a background
        export (it reads the states they change) and settle a load's masters (:meth:`settle_masters`)."""
        self.wait_state_dict()
        self.settle_masters()

    def settle_masters(self) -> None:
        """Convert the masters of the last load that depend on their parameters again, from the parameters as
        they are now (``formats.MasterConversion``: int16 remainders joined into a full master, a full master split
        into the parameter and remainders, a master made from the parameter). ``step()``, ``state_dict()``,
        ``prepare_state_dict()`` and ``initialize_states()`` call it first, so a framework that loads the model
        after the optimizer (DCP's ``set_state_dict``, torchtitan) gets the exact master without calling it; call it
        yourself only to read ``opt.state`` directly after a load. Once per load: nothing to do afterwards."""
        if self._loaded_masters and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "settle_masters: a load's masters are still to be converted from the loaded parameters: call "
                "optim_factory.checkpoint.finish_load(opt) once the model is loaded, before capturing a CUDA graph"
            )
        conversions, self._loaded_masters = self._loaded_masters, []
        for conversion in conversions:
            conversion.apply(self)

    def initialize_states(self) -> None:
        """Create the states every parameter's first ``step()`` creates (zeroed moments; with ``master_weights``
        the master copy of the parameter) and a ``step`` count of 0 in every group that has none (capturable: in
        those with parameters, on their device), without a gradient and without changing a parameter. Parameters
        that have states keep them. Until the first ``step()`` its ``state_dict()`` has states and a zero step,
        which ``load_state_dict`` refuses as it refuses any such dictionary (a checkpoint before any step has
        nothing to resume).

        For a resume: DCP's ``get_state_dict`` / ``get_optimizer_state_dict`` on an optimizer without states
        creates them by a ``step()`` on zero gradients (``_init_optim_state``), allocating a gradient for every
        parameter; with the states already there it does not. The ``step`` count puts the key into the template,
        so that the checkpoint's count is loaded. A first ``step()`` afterwards counts 1, as without this call.
        """
        self._wait_and_settle()
        for group in self.param_groups:
            if "step" not in group and not self.capturable:
                group["step"] = 0
            elif "step" not in group and group["params"]:
                group["step"] = torch.zeros([1], dtype=torch.int, device=local_tensor(group["params"][0]).device)
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    self.initialize_state(p, wants_remainders(self, p))

    def release_state_dict(self, state_dict: Any) -> int:
        """Give the pooled host buffers of an exported ``state_dict`` back for reuse; return how many.

        Any nesting works (the optimizer's own ``state_dict()`` or DCP's flattened one). Call it only when nothing
        reads those tensors any more (after the checkpoint that holds them is written): the next ``state_dict()``
        overwrites them. Other tensors are ignored; without a call the buffers are freed with the dictionary.
        A pending background export is waited for first (its failure stays for :meth:`wait_state_dict`).
        """
        self._exporter.join()
        return self._exporter.pool.release(state_dict)

    def share_export_memory(self) -> None:
        """Make the pooled host buffers of later exports in shared memory, pinned in place where they are pinned
        (``HostBufferPool.use_shared_memory``): another process then reads an export where it is, as
        ``StagerOptions(write_in_process=True)``'s writer process does. Free buffers are dropped (made again there
        at the next export); it stays so for the optimizer's life."""
        self._exporter.join()
        self._exporter.pool.use_shared_memory()

    def is_leased_export_buffer(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or a DTensor's local tensor) is a pooled export buffer not yet released: nothing
        but its holder reads or writes it until :meth:`release_state_dict` gives it back."""
        return self._exporter.pool.is_leased(tensor)

    def prepare_state_dict(self) -> Future | None:
        """With reused buffers: allocate, first-touch and pin the host buffers of the next export on a background
        thread (after the states exist, e.g. after the first step), so that even the first export streams at
        the link's bandwidth. Returns the background job's future (``None`` when buffers are not reused)."""
        if not (self._export_options.cpu_offload and self._export_options.reuse_buffers):
            return None
        self._exporter.join()
        self.settle_masters()
        with self._torch_hooks_held():  # the packing only: the user's hooks are for the export
            packed = torch.optim.Optimizer.state_dict(self)
        return self._plan().prepare(self, param_index_map(self, packed["param_groups"]))
