"""PortableFusedAdam + DCP on 2 real gloo ranks (CPU): DTensor states, flatten x sync/async, resharding.

The checks share three process groups (tests/distributed/launch.py spawn_checks): every 2-rank check and the
2-rank saves to reshard; the 1-rank loads of those and a 1-rank save; the 2-rank load of that save. Each test
reports its own check's outcome."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import workers
from tests.distributed.launch import spawn_checks

pytestmark = pytest.mark.slow  # spawned ranks

RESHARD = ["bf16-params-bf16-moments-fp32-master", "fp32-params-fp32-states", "bf16-moments-kept-bf16"]
ONE_TO_TWO = "bf16-params-bf16-moments-fp32-master"


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict[str, str | None]:
    tmp = tmp_path_factory.mktemp("dcp_portable")
    two = str(tmp / "two")
    one = str(tmp / "one")
    for d in (two, one):
        Path(d).mkdir()
    two_rank = [(f"roundtrip {cfg}", workers.dcp_roundtrip, (cfg, f"{two}/rt-{cfg}")) for cfg in workers.CONFIGS]
    two_rank += [
        ("full state export", workers.full_state_export, ("fp16-fp8-moments", f"{two}/full")),
        ("chunked export", workers.chunked_export, (f"{two}/chunked",)),
        ("async saves while training", workers.async_save_while_training, (f"{two}/async",)),
        ("background export failure", workers.background_export_failure, (f"{two}/bg",)),
        ("host dtensors keep their mesh", workers.host_wraps_keep_their_mesh, ()),
    ]
    two_rank += [(f"save {cfg} on 2", workers.save_for_reshard, (cfg, two)) for cfg in RESHARD]
    # last: a failure here leaves every other check run
    two_rank.append(("non-finite on one rank", workers.non_finite_on_one_rank, (f"{two}/nan",)))
    results = spawn_checks(2, two_rank, tmp / "done-2")
    one_rank = [(f"load {cfg} 2->1", workers.load_resharded, (cfg, two, 2)) for cfg in RESHARD]
    one_rank.append((f"save {ONE_TO_TWO} on 1", workers.save_for_reshard, (ONE_TO_TWO, one)))
    results.update(spawn_checks(1, one_rank, tmp / "done-1"))
    results.update(spawn_checks(2, [(f"load {ONE_TO_TWO} 1->2", workers.load_resharded, (ONE_TO_TWO, one, 1))],
                                tmp / "done-2b"))  # fmt: skip
    return results


def _passed(outcome, *names: str) -> None:
    for name in names:
        assert outcome[name] is None, f"{name}: {outcome[name]}"


@pytest.mark.parametrize("cfg", list(workers.CONFIGS))
def test_dcp_save_load_continue_two_ranks(outcome, cfg):
    _passed(outcome, f"roundtrip {cfg}")


def test_full_state_dict_export_with_and_without_dcp_cpu_offload(outcome):
    _passed(outcome, "full state export")


@pytest.mark.parametrize("cfg", RESHARD)
def test_two_rank_checkpoint_resumes_on_one_rank_bitwise(outcome, cfg):
    _passed(outcome, f"save {cfg} on 2", f"load {cfg} 2->1")


def test_one_rank_checkpoint_resumes_on_two_ranks_bitwise(outcome):
    _passed(outcome, f"save {ONE_TO_TWO} on 1", f"load {ONE_TO_TWO} 1->2")


def test_chunked_export_matches_per_state_on_dtensor_shards_and_through_dcp(outcome):
    _passed(outcome, "chunked export")


def test_async_saves_while_training_collectives_run_complete_and_load(outcome):
    _passed(outcome, "async saves while training")


def test_a_background_export_failing_on_one_rank_refuses_the_save_on_every_rank(outcome):
    _passed(outcome, "background export failure")


def test_a_nan_on_one_rank_refuses_the_save_on_every_rank(outcome):
    _passed(outcome, "non-finite on one rank")


def test_host_dtensors_keep_their_own_mesh(outcome):
    _passed(outcome, "host dtensors keep their mesh")
