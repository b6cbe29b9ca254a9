"""Distributed initialisation from the launcher's environment (torchrun, or one process without it)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class LaunchError(RuntimeError):
    """The launcher's environment is incomplete or inconsistent (one line)."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | single


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise LaunchError(f"{key}={env[key]!r}: expected an integer") from None


def resolve_dist_env(env: Mapping[str, str]) -> DistEnv:
    """Read rank, world size and rendezvous address from torchrun's variables; none set means one process."""
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    present = [k for k in keys if k in env]
    if not present:
        return DistEnv(0, 1, 0, "127.0.0.1", 0, "single")
    missing = [k for k in keys if k not in env]
    if missing:
        raise LaunchError(f"half-set launcher environment: {', '.join(present)} set but {', '.join(missing)} missing")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    if world < 1 or not 0 <= rank < world:
        raise LaunchError(f"RANK={rank}, WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    return DistEnv(rank, world, local_rank, env["MASTER_ADDR"], _int(env, "MASTER_PORT"), "torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested not in ("auto", "cpu", "cuda"):
        raise LaunchError(f"trainer.device={requested!r}: expected auto|cpu|cuda")
    if requested == "cuda" and not torch.cuda.is_available():
        raise LaunchError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu or auto")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init_distributed(env: DistEnv, device: torch.device) -> DeviceMesh:
    """Create the process group (gloo on CPU; ``cpu:gloo,cuda:nccl`` on CUDA) and a 1-D device mesh.

    On CUDA the group carries a CPU backend too: ``dcp.async_save`` refuses to run without one, and
    CPU-offloaded DTensor states cannot be gathered on NCCL alone.
    """
    if not dist.is_initialized():
        port = env.master_port or _free_port()
        kwargs = dict(init_method=f"tcp://{env.master_addr}:{port}", rank=env.rank, world_size=env.world_size)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, **kwargs)
        else:
            dist.init_process_group("gloo", **kwargs)
    return init_device_mesh(device.type, (env.world_size,))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
