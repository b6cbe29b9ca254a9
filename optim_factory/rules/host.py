"""What one rank may take of its host: how many ranks share the host, and the host budget ``"auto"`` gives each.

``state_dict_offload_host_budget="auto"`` is :data:`AUTO_HOST_SHARE` of the memory the host has available when the
optimizer is built (Linux's ``MemAvailable``: free memory and what the kernel can reclaim at once), split evenly
among the host's ranks, as torchsnapshot sizes its per-rank memory budget: the ranks of a node saving at once
together hold at most that share, whatever the size of their states, and the rest stays for the training itself
(the data loader's workers, pinned buffers, the page cache of the files being written).
"""

from __future__ import annotations

import os
import re

__all__ = ["AUTO_HOST_SHARE", "auto_host_budget", "available_host_bytes", "local_ranks"]

AUTO_HOST_SHARE = 0.6  # of the host's available memory, for all its ranks' saves together


def local_ranks() -> int:
    """The processes of the job on this host: ``LOCAL_WORLD_SIZE`` (torchrun sets it; a value that is not a positive
    integer raises), else, inside an ``srun`` step, this node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (``"4"``,
    ``"2(x3),1"``: one count per node, ``SLURM_NODEID``'s), else 1."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is not None:
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE={raw!r}: expected a positive integer (torchrun sets it)")
        return int(raw)
    return _slurm_step_tasks_here(os.environ.get("SLURM_STEP_TASKS_PER_NODE"), os.environ.get("SLURM_NODEID", "0"))


def _slurm_step_tasks_here(tasks_per_node: str | None, node: str) -> int:
    """This node's count of a Slurm step's ``N(xM),...`` list; 1 where it is absent or not in that form."""
    counts: list[int] = []
    for part in (tasks_per_node or "").split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if found is None:
            return 1
        counts += [int(found[1])] * int(found[2] or 1)
    index = int(node) if node.strip().isdigit() else 0
    return max(1, counts[index]) if index < len(counts) else 1


def available_host_bytes() -> int:
    """The host memory available now: ``MemAvailable`` of ``/proc/meminfo`` on Linux, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_host_budget(available: int | None = None, ranks: int | None = None) -> int:
    """This rank's share of the host memory for a save: ``AUTO_HOST_SHARE * available // ranks`` (by default the
    host's :func:`available_host_bytes` and :func:`local_ranks`)."""
    available = available_host_bytes() if available is None else available
    return int(AUTO_HOST_SHARE * available) // (local_ranks() if ranks is None else ranks)
