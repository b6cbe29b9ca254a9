"""The ranks' agreement on a staged save: every rank's refusal line gathered on the stager's group, so that a save
one rank refuses is refused on every rank, each naming all the reasons."""

from __future__ import annotations

import torch.distributed as dist

from optim_factory.errors import first_line


def agree(failure: str | None, group) -> list[str]:
    """Every rank's refusal (``line (rank N)``), gathered on ``group``; empty when none refused. ``group`` None: one
    process (the stager makes a group wherever there are more). A gathering that fails is this rank's refusal."""
    try:
        return gathered(failure, group)
    except BaseException as exc:  # noqa: BLE001  (a collective's failure must not end the save's thread)
        return [f"{first_line(exc, named=True)} (rank {rank_in(group)})"]


def gathered(failure: str | None, group) -> list[str]:
    """:func:`agree`'s gathering, whose failure (a rank that ended) raises."""
    if group is None:
        return [] if failure is None else [f"{failure} (rank {rank_in(group)})"]
    lines: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(lines, failure, group=group)
    return [f"{line} (rank {rank})" for rank, line in enumerate(lines) if line is not None]


def rank_in(group) -> int:
    """This process's rank in the agreement's group (the ranks a refusal names)."""
    return dist.get_rank(group) if dist.is_initialized() else 0
