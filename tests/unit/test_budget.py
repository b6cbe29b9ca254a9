"""optim_factory.checkpoint.BudgetSavePlanner: a plain DCP save of a chunked export within a host budget writes the
same data files as the save without it and holds at most the budget on the host (measured: the process's peak
resident memory, reset before each save); bad budgets, and checkpointers that would export whole, are one line."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import (
    AsyncSaveStager,
    BudgetRefused,
    BudgetSavePlanner,
    SafeFileSystemReader,
    SafeLoadPlanner,
)
from optim_factory.errors import ConfigError
from optim_factory.rules.host import AUTO_HOST_SHARE, auto_host_budget
from tests.recipe.runs import QUICK, cli, refused
from tests.unit.saves import data_files

CHUNK = 1 << 20
STATE = 4 << 20  # each FP32 state of a Linear(1024, 1024) weight
OPTIONS = dict(lr=1e-3, state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=CHUNK)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_added(save) -> int:
    """Bytes ``save()`` added at its peak to this process's resident memory (Linux's high-water mark, reset)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(f"the peak resident memory cannot be reset here: {exc}")
    base = _status("VmRSS")
    save()
    return _status("VmHWM") - base


def _trained(budget=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
    opt = PortableFusedAdam(model.parameters(), **OPTIONS, state_dict_offload_host_budget=budget)
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()
    return model, opt


def train(model, opt) -> None:
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()


def test_a_save_within_the_budget_writes_the_same_files_and_holds_at_most_the_budget(tmp_path):
    budget = 2 * STATE
    model, opt = _trained(budget)
    plain, within = tmp_path / "plain", tmp_path / "within"

    def save_plain():
        msd, osd = get_state_dict(model, opt)
        writer = FileSystemWriter(plain, per_thread_copy_ahead=0)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer, no_dist=True)

    def save_within():
        planner = BudgetSavePlanner(opt)
        with planner.exporting():
            msd, osd = get_state_dict(model, opt)
        planner.save({"model": msd, "optim": osd}, within, no_dist=True)
        assert planner.peak_bytes <= budget

    exported = 24 * STATE  # exp_avg and exp_avg_sq of 12 weights (the biases' states are small)
    assert _peak_added(save_plain) > exported  # the measure sees a whole export
    # the budget, the fills' staging ring (two chunks), and DCP's and Python's own allocations: 0-380 KB measured
    # beyond the first two
    assert _peak_added(save_within) <= budget + 2 * CHUNK + (512 << 10)
    assert data_files(within) == data_files(plain)
    shutil.rmtree(plain)


class Recording(BudgetSavePlanner):
    """The planner, keeping each save's host states that DCP's writer was given (alive: two saves' are told apart
    by identity)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.given: list[list[torch.Tensor]] = []

    def begin(self, *args, **kwargs):
        self.given.append([])
        return super().begin(*args, **kwargs)

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.numel() > 1:  # a state (not a step count)
            self.given[-1].append(data)
        return data


def test_a_save_that_fits_the_budget_whole_keeps_its_buffers_for_the_next_and_writes_the_same_files(tmp_path):
    whole = 12 * 2 * (1024 * 1024 + 1024) * 4  # exp_avg and exp_avg_sq of every parameter, FP32
    model, opt = _trained(whole)
    planner = Recording(opt)
    for name in ("first", "second"):
        train(model, opt)
        dcp.save({"optim": get_state_dict(model, opt)[1]}, checkpoint_id=tmp_path / f"{name}_plain", no_dist=True)
        with planner.exporting():
            osd = get_state_dict(model, opt)[1]
        planner.save({"optim": osd}, tmp_path / name, no_dist=True)
        assert data_files(tmp_path / name) == data_files(tmp_path / f"{name}_plain")
        assert planner.kept_bytes == whole
        assert all(t.count_nonzero() for t in planner.given[-1])  # kept with their values: no page given back
    assert len(planner.given[1]) == 48 and all(a is b for a, b in zip(*planner.given))
    planner.save({"moved": osd}, tmp_path / "moved", no_dist=True)  # another layout that fits: only its buffers
    assert planner.kept_bytes == whole and not any(a is b for a, b in zip(planner.given[1], planner.given[2]))
    planner.save({"optim": osd, "again": osd}, tmp_path / "twice", no_dist=True)  # twice the budget: streamed
    assert planner.kept_bytes == 0
    assert not any(a is b for a, b in zip(planner.given[2], planner.given[3]))
    planner.save({"optim": osd}, tmp_path / "third", no_dist=True)
    assert planner.kept_bytes == whole and data_files(tmp_path / "third") == data_files(tmp_path / "second")


@pytest.mark.parametrize(
    "value, reason",
    [
        ("lots", "expected null (no cap), auto (a share of the host), bytes as an int or a size like 512MiB"),
        (True, "expected null (no cap), auto (a share of the host), bytes as an int or a size like 512MiB"),
        (
            CHUNK,
            "expected at least two chunks of state_dict_offload_chunk_bytes=1048576 (2097152 bytes; a smaller chunk "
            "lowers it)",
        ),
    ],
)
def test_a_budget_that_is_not_a_size_of_two_chunks_is_one_line(value, reason):
    with pytest.raises(
        ConfigError,
        match=f"^state_dict_offload_host_budget={value!r}: {reason}$".replace("(", r"\(").replace(")", r"\)"),
    ):
        PortableFusedAdam([torch.nn.Parameter(torch.zeros(4))], **OPTIONS, state_dict_offload_host_budget=value)


def test_an_auto_budget_is_the_rank_s_share_of_the_host_where_the_export_has_a_budget(monkeypatch):
    """``"auto"``: 60 % of the host's available memory split among its ranks, at least two chunks; no budget in a
    mode that has none (reused buffers, the background export, no chunks) rather than a refusal. Broken on purpose
    (the share not split among the ranks): four ranks get the host's whole share each."""
    params = [torch.nn.Parameter(torch.zeros(4))]
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_STEP_TASKS_PER_NODE", raising=False)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    alone = PortableFusedAdam(params, **OPTIONS, state_dict_offload_host_budget="auto").export_options.host_budget
    assert 2 * CHUNK < alone <= AUTO_HOST_SHARE * total, alone
    assert auto_host_budget(available=10 << 30, ranks=4) == int(AUTO_HOST_SHARE * (10 << 30)) // 4
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3),4")  # srun's, where torchrun's is unset: node 3's
    monkeypatch.setenv("SLURM_NODEID", "3")
    quarter = PortableFusedAdam(params, **OPTIONS, state_dict_offload_host_budget="auto").export_options.host_budget
    assert quarter < alone / 2, (quarter, alone)  # the available memory moves a little between the two
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10**9))  # torchrun's first; a share below two chunks is two chunks
    tiny = PortableFusedAdam(params, **OPTIONS, state_dict_offload_host_budget="auto").export_options.host_budget
    assert tiny == 2 * CHUNK
    for mode in ({"state_dict_offload_reuse_buffers": True}, {"state_dict_offload_background": True}, {}):
        options = {**OPTIONS, **mode} if mode else {}
        opt = PortableFusedAdam(params, **options, state_dict_offload_host_budget="auto")
        assert opt.export_options.host_budget is None, mode


def test_a_budget_with_reused_buffers_or_without_chunks_is_one_line():
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ConfigError, match="cannot be combined with state_dict_offload_reuse_buffers=True"):
        PortableFusedAdam(
            params, **OPTIONS, state_dict_offload_reuse_buffers=True, state_dict_offload_host_budget="8MiB"
        )
    with pytest.raises(ConfigError, match="needs a chunked export"):
        PortableFusedAdam(params, state_dict_offload_host_budget="8MiB")


def test_a_budget_below_the_largest_tensor_or_a_writer_of_several_threads_is_refused_before_writing(tmp_path):
    """The writer holds the tensor it writes; a writer thread of several whose write failed would leave its fills
    holding the budget while the others wait for theirs."""
    model, opt = _trained(2 * CHUNK)
    planner = BudgetSavePlanner(opt)
    with planner.exporting():
        msd, osd = get_state_dict(model, opt)
    line = (
        r"^state_dict_offload_host_budget=2097152: the save holds the tensor it writes \(4194304 bytes, the largest\)"
    )
    line += r" and the copies made at its start \(0\): a budget of at least 4MiB \(4194304 bytes\)$"
    with pytest.raises(ValueError, match=line):
        planner.save({"model": msd, "optim": osd}, tmp_path / "ck", no_dist=True)
    assert not list((tmp_path / "ck").glob("*.distcp"))
    stager = AsyncSaveStager(_trained(2 * STATE)[1])
    with pytest.raises(BudgetRefused, match="^BudgetSavePlanner: a save within the budget writes .* with one thread"):
        stager.async_save({}, storage_writer=FileSystemWriter(tmp_path / "w", thread_count=2, per_thread_copy_ahead=0))
    stager.close()


def test_a_save_through_another_writer_or_of_a_copy_of_the_export_is_refused(tmp_path):
    """Another writer may ask for items ahead of its writes; a copy of a placeholder holds no data (a meta tensor);
    a save of nothing exported, or after a step, would save other states than the export's."""
    model, opt = _trained(2 * STATE)
    planner = BudgetSavePlanner(opt)
    with planner.exporting():
        msd, osd = get_state_dict(model, opt)
    with pytest.raises(CheckpointException, match=r"BudgetSavePlanner: save with planner.save\(...\)"):
        dcp.save({"optim": osd}, checkpoint_id=str(tmp_path / "dcp"), planner=planner, no_dist=True)
    with pytest.raises(CheckpointException, match="Cannot copy out of meta tensor|meta"):
        dcp.save({"optim": osd}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)  # no planner: loud, not zeros
    copied = {"optim": {"state": {i: {n: t.clone() for n, t in st.items()} for i, st in osd["state"].items()}}}
    with pytest.raises(ValueError, match="^BudgetSavePlanner: 48 of the export's states are not values of the state"):
        planner.save(copied, tmp_path / "copy", no_dist=True)
    with pytest.raises(ValueError, match=r"^BudgetSavePlanner: the optimizer.s state dict was not exported inside"):
        BudgetSavePlanner(opt).save({"optim": osd}, tmp_path / "nothing", no_dist=True)
    with pytest.raises(
        ValueError, match=r"^BudgetSavePlanner: tuple holds a meta tensor \(a placeholder\) inside a value DCP pickles"
    ):
        first = next(iter(osd["state"].values()))
        planner.save({"optim": osd, "tuple": (first["exp_avg"],)}, tmp_path / "pickled", no_dist=True)
    train_step = torch.nn.functional.mse_loss(model(torch.randn(4, 1024)), torch.zeros(4, 1024))
    train_step.backward()
    opt.step()
    with pytest.raises(ValueError, match=r"^BudgetSavePlanner: the optimizer stepped since the export"):
        planner.save({"optim": osd}, tmp_path / "stepped", no_dist=True)
    assert not [p for p in tmp_path.glob("*/*.distcp") if p.parent.name != "plain"]
    assert not (tmp_path / "plain" / ".metadata").exists()  # DCP's failed write: never a checkpoint


def test_the_export_saves_again_and_under_two_keys_with_the_same_files(tmp_path):
    model, opt = _trained(2 * STATE)
    planner = BudgetSavePlanner(opt)
    with planner.exporting():
        msd, osd = get_state_dict(model, opt)
        planner.save({"optim": osd}, tmp_path / "inside", no_dist=True)  # as after the block
    planner.save({"optim": osd}, tmp_path / "a", no_dist=True)
    assert data_files(tmp_path / "inside") == data_files(tmp_path / "a")
    planner.save({"optim": osd}, tmp_path / "b", no_dist=True)
    assert data_files(tmp_path / "a") == data_files(tmp_path / "b")
    train(model, opt)  # the documented path after a step: export again with the same planner
    with planner.exporting():
        osd = get_state_dict(model, opt)[1]
    planner.save({"optim": osd}, tmp_path / "after_step", no_dist=True)
    planner.save({"optim": osd, "again": osd}, tmp_path / "twice", no_dist=True)
    loaded = {"optim": get_state_dict(model, opt)[1], "again": get_state_dict(model, opt)[1]}
    dcp.load(
        loaded, storage_reader=SafeFileSystemReader(str(tmp_path / "twice")), planner=SafeLoadPlanner(), no_dist=True
    )
    for key in ("optim", "again"):
        for idx, states in loaded[key]["state"].items():
            for name, t in states.items():
                assert torch.equal(t, opt.state[dict(model.named_parameters())[idx]][name]), (key, idx, name)


def test_a_planner_without_a_budget_and_a_recipe_budget_that_is_not_a_size_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="^BudgetSavePlanner: the optimizer has no state_dict_offload_host_budget$"):
        BudgetSavePlanner(_trained()[1])
    two_chunks = (
        "expected at least two chunks of optim.state_dict_offload_chunk_bytes=67108864 (134217728 bytes; a smaller "
        "chunk lowers it)"
    )
    not_a_size = "expected null (no cap), auto (a share of the host), bytes as an int or a size like 512MiB"
    for value, reason in (("lots", not_a_size), ("1KiB", two_chunks)):
        budget = ["optim.state_dict_cpu_offload=true", f"optim.state_dict_offload_host_budget={value}"]
        assert refused(cli(*QUICK, f"run_dir={tmp_path}", *budget)) == (
            f"optim.state_dict_offload_host_budget={value!r}: {reason}"
        )
