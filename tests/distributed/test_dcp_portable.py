"""PortableFusedAdam + DCP on 2 real gloo ranks (CPU): DTensor states, flatten x sync/async, resharding."""

from __future__ import annotations

import pytest

from tests.distributed import workers
from tests.distributed.launch import spawn


@pytest.mark.parametrize("cfg", list(workers.CONFIGS))
def test_dcp_save_load_continue_two_ranks(cfg, tmp_path):
    spawn(workers.dcp_roundtrip, 2, cfg, str(tmp_path))


def test_full_state_dict_export_with_and_without_dcp_cpu_offload(tmp_path):
    spawn(workers.full_state_export, 2, "fp16-fp8-moments", str(tmp_path))


@pytest.mark.parametrize(
    "cfg", ["bf16-params-bf16-moments-fp32-master", "fp32-params-fp32-states", "bf16-moments-kept-bf16"]
)
def test_two_rank_checkpoint_resumes_on_one_rank_bitwise(cfg, tmp_path):
    spawn(workers.save_for_reshard, 2, cfg, str(tmp_path))
    spawn(workers.load_resharded, 1, cfg, str(tmp_path), 2)


def test_one_rank_checkpoint_resumes_on_two_ranks_bitwise(tmp_path):
    cfg = "bf16-params-bf16-moments-fp32-master"
    spawn(workers.save_for_reshard, 1, cfg, str(tmp_path))
    spawn(workers.load_resharded, 2, cfg, str(tmp_path), 1)


def test_chunked_export_matches_per_state_on_dtensor_shards_and_through_dcp(tmp_path):
    spawn(workers.chunked_export, 2, str(tmp_path))


def test_async_saves_while_training_collectives_run_complete_and_load(tmp_path):
    spawn(workers.async_save_while_training, 2, str(tmp_path))


def test_a_background_export_failing_on_one_rank_refuses_the_save_on_every_rank(tmp_path):
    spawn(workers.background_export_failure, 2, str(tmp_path))


def test_host_dtensors_keep_their_own_mesh():
    spawn(workers.host_wraps_keep_their_mesh, 2)
