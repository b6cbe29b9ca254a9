"""Empty local shards (FSDP2 on 2 real gloo ranks, CPU): PortableFusedAdam and build_optimizer(backend=portable),
every state configuration: step, export, DCP save, load, continue, and the full (gathered) state dict."""

from __future__ import annotations

import pytest

from tests.distributed import empty_shards
from tests.distributed.launch import spawn

pytestmark = pytest.mark.slow  # spawned ranks and processes


def test_empty_local_shards_lifecycle_and_full_state_dict_every_configuration(tmp_path):
    spawn(empty_shards.lifecycle, 2, "portable", str(tmp_path))
