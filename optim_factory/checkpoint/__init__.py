"""Everything a checkpointer needs from optim-factory, for any ``torch.optim.Optimizer`` (for ours each piece does
what its name says, for another optimizer what DCP does without it), in one import (docs/export.md):

* Saves: :class:`AsyncSaveStager`, DCP's ``AsyncStager`` kept across saves (and ``AsyncSaveStager.save``, the same
  save waited for), and its options
  :class:`StagerOptions` (the export's buffers written uncopied, the model into reused pinned copies, a
  background export completed, the write in a writer process of the rank's own, a failed or non-finite save
  refused on every rank before DCP writes:
  :class:`SaveRefused`, whose reasons start with
  :data:`EXPORT_FAILED_LINE` or :data:`NON_FINITE_LINE`); :class:`BudgetSavePlanner` and :func:`host_budget`, a
  save within ``state_dict_offload_host_budget`` (its refusals: :class:`BudgetRefused`), and
  :func:`least_host_budget` (:class:`LeastBudget`), the least budget a save needs, for a check before training;
  :class:`HostCopies`, reusable host copies of a state dict.
* Loads: :class:`ExactLoadPlanner` (every optimizer state in its saved dtype, converted exactly),
  :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` (a checkpoint read as data; refusals:
  :class:`UnsafeCheckpoint`), :func:`prepare_load` and :func:`finish_load` around a load.
* The deferral of a hand-written async loop: :func:`deferred_export`, :func:`defers_export`,
  :func:`export_failure`, :func:`export_buffer_test`, :func:`release_export`; :func:`cpus_per_rank`.

The modules behind this face are private (``_stager``, ``_options``, ``_fillers``, ``_export_waits``, ``_verdict``,
``_record``, ``_save_end``, ``_agreement``, ``_writer_process``, ``_main_guard``, ``_shared_send``,
``_remote_fills``, ``_budget``, ``_budget_rule``, ``_fill_memory``, ``_fills``, ``_gated_planner``,
``_finite_check``, ``_host_copies``, ``_load_planner``, ``_deferral``, ``_safe_read``): import from here.
"""

from optim_factory.checkpoint._budget import BudgetSavePlanner
from optim_factory.checkpoint._budget_rule import BudgetRefused, LeastBudget, host_budget, least_host_budget
from optim_factory.checkpoint._deferral import (
    deferred_export,
    defers_export,
    export_buffer_test,
    export_failure,
    release_export,
)
from optim_factory.checkpoint._export_waits import EXPORT_FAILED_LINE
from optim_factory.checkpoint._finite_check import NON_FINITE_LINE
from optim_factory.checkpoint._host_copies import HostCopies
from optim_factory.checkpoint._load_planner import STATE_NAMES, ExactLoadPlanner, finish_load, prepare_load
from optim_factory.checkpoint._options import DEFAULT_EXPORT_TIMEOUT_S, StagerOptions
from optim_factory.checkpoint._safe_read import SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpoint
from optim_factory.checkpoint._stager import AsyncSaveStager
from optim_factory.errors import SaveRefused
from optim_factory.optimizers.export import cpus_per_rank

__all__ = [
    "AsyncSaveStager",
    "StagerOptions",
    "SaveRefused",
    "EXPORT_FAILED_LINE",
    "DEFAULT_EXPORT_TIMEOUT_S",
    "NON_FINITE_LINE",
    "BudgetSavePlanner",
    "host_budget",
    "BudgetRefused",
    "least_host_budget",
    "LeastBudget",
    "HostCopies",
    "ExactLoadPlanner",
    "STATE_NAMES",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpoint",
    "prepare_load",
    "finish_load",
    "deferred_export",
    "defers_export",
    "export_failure",
    "export_buffer_test",
    "release_export",
    "cpus_per_rank",
]
