"""What the async-save tests share: a small model, a few training steps, a deferred export as a checkpointer saves
it, the tensors a checkpoint of a moment holds, a bitwise check of a written checkpoint, an export held unfilled,
a planner and a writer that say when DCP planned, a writer held at a gate, and a checkpoint's data files."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from optim_factory.checkpoint import deferred_export
from recipes.checkpoint import read_checkpoint
from tests.helpers import assert_bitwise

OURS = dict(
    exp_avg_dtype=torch.bfloat16,
    state_dict_cpu_offload=True,
    state_dict_offload_chunk_bytes=4096,
    state_dict_offload_reuse_buffers=True,
    state_dict_offload_background=True,
)


class Optim:
    """A ``Stateful`` optimizer entry: DCP exports it inside ``async_save`` (as torchtitan's container)."""

    def __init__(self, model, opt) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict:
        return get_state_dict(self.model, self.opt)[1]

    def load_state_dict(self, state_dict: dict) -> None:
        raise AssertionError("not loaded here")


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))


def train(model, opt, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def export_deferred(model, opt) -> dict:
    """What a checkpointer saves: model and optimizer, the export deferred (a background export returns unfilled)."""
    with deferred_export(opt):
        msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def expected_tensors(model, opt) -> dict[str, torch.Tensor]:
    """The flat tensors a checkpoint of this moment holds (a synchronous export, its own buffers)."""
    msd, osd = get_state_dict(model, opt)
    flat = {f"model.{k}": v.clone() for k, v in msd.items()}
    for idx, states in osd["state"].items():
        flat.update({f"optim.state.{idx}.{name}": v.clone() for name, v in states.items()})
    opt.release_state_dict(osd)
    return flat


def assert_checkpoint(path: Path, expected: dict[str, torch.Tensor]) -> None:
    written = read_checkpoint(path)
    for key, value in expected.items():
        assert_bitwise(written[key], value, f"{path.name} {key}")


class StuckExport:
    """The optimizer's exporter with its export's thread held at ``gate`` (an export not yet filled)."""

    def __init__(self, monkeypatch) -> None:
        from optim_factory.optimizers.export import mixin

        self.gate = gate = threading.Event()
        gate.set()

        class Stuck(mixin.StateExporter):
            def _stream_after(self, *args):
                gate.wait(60)
                return super()._stream_after(*args)

        monkeypatch.setattr(mixin, "StateExporter", Stuck)


class PlannedWriter(FileSystemWriter):
    """DCP's file writer, which says when DCP's planning reaches it (``planned``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.planned = threading.Event()

    def prepare_local_plan(self, plan):
        self.planned.set()
        return super().prepare_local_plan(plan)


class GatedFileWriter(FileSystemWriter):
    """DCP's file writer whose ``write_data`` waits until the file ``gate`` exists (a write in flight, held also in a
    writer process: it pickles); ``planning``: its ``prepare_local_plan`` waits instead (the save's plan held before
    it is final); ``kwargs``: ``FileSystemWriter``'s."""

    def __init__(self, path: str, gate: str, planning: bool = False, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.gate, self.planning = gate, planning

    def prepare_local_plan(self, plan):
        if self.planning:
            self._wait()
        return super().prepare_local_plan(plan)

    def write_data(self, plan, planner):
        if not self.planning:
            self._wait()
        return super().write_data(plan, planner)

    def _wait(self) -> None:
        while not os.path.exists(self.gate):
            time.sleep(0.01)


class PlanWatcher(DefaultSavePlanner):
    """DCP's save planner, which says when its local plan is made."""

    def __init__(self) -> None:
        super().__init__()
        self.planned = threading.Event()

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.planned.set()
        return plan


def data_files(path: Path) -> dict[str, str]:
    """Each data file's hash (``.metadata`` names the checkpoint and a random save id: it differs between any two
    saves)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir() if p.name != ".metadata"}
