"""Run one worker of tests/distributed/workers.py under torchrun (CPU/gloo or CUDA/nccl+gloo).

    torchrun --standalone --nproc_per_node=2 -m tests.distributed.run_worker <worker> <backend> <arg>...

<worker>: a function of workers.py, or ``<module>.<function>`` of another module of tests/distributed, which
takes the backend as its first argument after rank and world. <backend>: portable | te. On CUDA the group is
``cpu:gloo,cuda:nccl`` and each rank uses cuda:LOCAL_RANK.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.distributed as dist

from tests.distributed import workers


def main(argv: list[str]) -> None:
    name, backend, *args = argv
    workers.BACKEND["name"] = backend
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    converted = [int(a) if a.isdigit() else a for a in args]
    module_name, _, function = name.rpartition(".")
    if module_name:
        module = importlib.import_module(f"tests.distributed.{module_name}")
        getattr(module, function)(rank, world, backend, *converted)
    else:
        getattr(workers, name)(rank, world, *converted)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {name} ok", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
