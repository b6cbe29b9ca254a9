"""2 GPUs: FSDP2-style DTensor parameters + TE FusedAdam + DCP (torchrun, cpu:gloo,cuda:nccl), and the recipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import workers

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.two_gpus
ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def torchrun(nproc: int, *args: str, timeout: int = 300) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], "\n----- stderr -----\n", proc.stderr[-12000:])  # shown in the test report
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}: see the captured output"
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("cfg", list(workers.CONFIGS))
def test_fsdp_te_dcp_flatten_sync_async_export_restore_continue(cfg, tmp_path):
    out = torchrun(2, "-m", "tests.distributed.run_worker", "dcp_roundtrip", "te", cfg, str(tmp_path))
    assert out.count("dcp_roundtrip ok") == 2


def test_chunked_export_through_dcp_bitwise_and_within_two_chunks(tmp_path):
    out = torchrun(2, "-m", "tests.distributed.run_worker", "chunked_export", "te", str(tmp_path))
    assert out.count("chunked_export ok") == 2
    records = [line for line in out.splitlines() if line.startswith("CHUNKED_DCP ")]
    assert len(records) == 2 * len(workers.CONFIGS) * 6  # ranks x configs x (fresh, reuse, background) x 2 rounds
    results = os.environ.get("GPU_RESULTS")
    if results:
        with open(results, "a") as f:
            f.writelines(line.removeprefix("CHUNKED_DCP ") + "\n" for line in records)


def test_full_state_export_default_and_cpu(tmp_path):
    out = torchrun(
        2, "-m", "tests.distributed.run_worker", "full_state_export", "te", "fp16-fp8-moments", str(tmp_path)
    )
    assert out.count("full_state_export ok") == 2


@pytest.mark.parametrize("cfg", ["bf16-params-bf16-moments-fp32-master", "fp32-params-fp32-states"])
def test_two_rank_checkpoint_on_one_rank_bitwise(cfg, tmp_path):
    torchrun(2, "-m", "tests.distributed.run_worker", "save_for_reshard", "te", cfg, str(tmp_path))
    out = torchrun(1, "-m", "tests.distributed.run_worker", "load_resharded", "te", cfg, str(tmp_path), "2")
    assert "load_resharded ok" in out


@pytest.mark.parametrize(
    "export",
    [
        [],
        [
            "optim.state_dict_offload_chunk_bytes=1MiB",
            "optim.state_dict_offload_reuse_buffers=true",
            "checkpoint.async_save=true",
        ],
    ],
    ids=["per-state", "chunked-reuse-async"],
)
def test_recipe_two_gpus_offload_trains_saves_resumes(export, tmp_path):
    common = [
        "recipes/train.py",
        *export,
        "experiment=quick",
        "trainer.device=cuda",
        "optim=fused_adam",
        "optim.state_dict_cpu_offload=true",
        "optim.master_weights=true",
        "optim.exp_avg_dtype=bf16",
        "optim.exp_avg_sq_dtype=bf16",
        "model.dtype=bf16",
        f"run_dir={tmp_path}",
    ]
    first = torchrun(2, *common, "trainer.stop_at=10")
    assert "optimizer: FusedAdam" in first and "GPU peak" in first and "GB/s" in first
    second = torchrun(2, *common)
    assert "resuming from checkpoint" in second and "step_00000010" in second
    assert (tmp_path / "checkpoints" / "step_00000020" / "COMPLETE.json").is_file()
