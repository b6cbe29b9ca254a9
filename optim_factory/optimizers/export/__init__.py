"""The export path shared by both FusedAdam backends, one job per module (docs/design.md, "Export"):

* :mod:`.plan`: one export, state by state, as its options say (``ExportPlan``, ``export_state``);
* :mod:`.contract`: the load contract and the load (``check_loadable``, ``load_exported_state``);
* :mod:`.formats`: a master's saved and live formats and the conversion between them (``load_master``);
* :mod:`.options`: the frozen, validated export options (``ExportOptions``, ``Pinning``) and the names users
  spell them by (``OPTION_NAMES``);
* :mod:`.stream`: chunk planning and the stream pipeline with its resources (``StateExporter``, ``StreamItem``);
* :mod:`.host_memory`: host memory and pinning (``host_empty``, ``HostBufferPool``, ``Slot``, ``give_pages_back``,
  ``shared_empty``, ``register_host`` and ``unregister_host``);
* :mod:`.threads`: the export's thread pools (``worker_threads``, ``ProcessThreads``);
* :mod:`.tensors`: DTensor and BF16-remainder bit helpers, shared with the portable backend;
* :mod:`.mixin`: ``OffloadedStateDict``, the ``state_dict`` family both optimizer classes inherit.
"""

from optim_factory.optimizers.export.contract import load_exported_state, param_index_map
from optim_factory.optimizers.export.formats import MASTER
from optim_factory.optimizers.export.host_memory import (
    HostBufferPool,
    Slot,
    give_pages_back,
    host_empty,
    register_host,
    shared_empty,
    unregister_host,
)
from optim_factory.optimizers.export.mixin import OffloadedStateDict
from optim_factory.optimizers.export.options import (
    DEFAULT_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    OPTION_NAMES,
    ExportOptions,
    Pinning,
)
from optim_factory.optimizers.export.plan import ExportPlan, export_state
from optim_factory.optimizers.export.staging import cpus_per_rank
from optim_factory.optimizers.export.stream import StateExporter, StreamItem, plan_chunks
from optim_factory.optimizers.export.tensors import (
    all_finite,
    join_bf16_remainder,
    local_tensor,
    split_bf16_remainder,
    wrap_host_local,
    wrap_like,
)

__all__ = [
    "export_state",
    "load_exported_state",
    "param_index_map",
    "ExportOptions",
    "ExportPlan",
    "OPTION_NAMES",
    "Pinning",
    "DEFAULT_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "OffloadedStateDict",
    "StateExporter",
    "StreamItem",
    "plan_chunks",
    "HostBufferPool",
    "Slot",
    "give_pages_back",
    "host_empty",
    "register_host",
    "shared_empty",
    "unregister_host",
    "local_tensor",
    "wrap_like",
    "wrap_host_local",
    "join_bf16_remainder",
    "split_bf16_remainder",
    "all_finite",
    "MASTER",
    "cpus_per_rank",
]
