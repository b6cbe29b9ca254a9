"""A checkpoint read as data through plain DCP (optim_factory.checkpoint.SafeFileSystemReader, SafeLoadPlanner,
ExactLoadPlanner): everything DCP writes loads bitwise as DCP's own reader and planner load it; a planted
``.metadata``, a planted item and a storage path outside the folder are refused in one line before anything of
them runs, and nothing is read into the state dict."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from optim_factory import PortableFusedAdam
from optim_factory.checkpoint import ExactLoadPlanner, SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpoint
from tests.planted import RunsACommand, move_storage, plant_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HOW = "a type of your own that you trust loads once you allow it with torch.serialization.add_safe_globals"


def values() -> dict:
    """Tensors of every dtype our exports write, and the non-tensor values DCP pickles (an RNG state, a trainer's
    counters; an optimizer's param groups: the next test)."""
    gen = torch.Generator().manual_seed(0)
    out = {
        f"t.{dtype}".replace("torch.", ""): torch.randn(5, 3, generator=gen).to(dtype)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int16, torch.uint8)
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["t.float8"] = torch.randn(4, generator=gen).to(torch.float8_e4m3fn)
    out["rng"] = torch.get_rng_state()
    out.update(step=7, loss=1.25, name="run", betas=(0.9, 0.95), nothing=None, size=torch.Size([2, 3]))
    return out


def save(path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def template(state: dict) -> dict:
    """Zeros of each tensor, a placeholder for each other value (what a load reads into)."""
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def safe_load(state: dict, path, planner=None) -> None:
    dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner or SafeLoadPlanner(), no_dist=True)


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
        else:
            assert got[k] == v, k


def test_everything_dcp_writes_loads_bitwise_as_dcp_loads_it(tmp_path):
    state = values()
    save(tmp_path, state)
    ours, theirs = template(state), template(state)
    safe_load(ours, tmp_path)
    dcp.load(theirs, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    assert_same(ours, state)
    assert_same(ours, theirs)


def test_an_optimizer_loads_exactly_through_the_safe_pair(tmp_path):
    """Int16 remainders saved, an FP32 master resumed: ExactLoadPlanner is a SafeLoadPlanner, and the read through
    SafeFileSystemReader is exact (the docs' loop: get_state_dict, then set_state_dict)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from optim_factory.checkpoint import prepare_load
    from optim_factory.optimizers.export import join_bf16_remainder

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    saved = PortableFusedAdam(model.parameters(), lr=1e-2, master_weights=True, store_param_remainders=True)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    saved.step()
    save(tmp_path, {"optim": get_state_dict(model, saved)[1]})
    resumed = PortableFusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    prepare_load(resumed)
    target = {"optim": get_state_dict(model, resumed)[1]}
    safe_load(target, tmp_path, ExactLoadPlanner())
    set_state_dict(model, resumed, model_state_dict={}, optim_state_dict=target["optim"])
    for p in model.parameters():
        want = join_bf16_remainder(p.detach(), saved.state[p]["master_param"])
        assert torch.equal(resumed.state[p]["master_param"], want)


@pytest.mark.parametrize("how", ["constructed", "dcp.load(checkpoint_id=...)", "DCP's own read"])
def test_a_planted_metadata_is_refused_before_it_runs(tmp_path, how):
    state = values()
    save(tmp_path / "ckpt", state)
    marker = tmp_path / "ran"
    target = template(state)
    if how == "DCP's own read":  # given a good folder, then changed before DCP reads it: read_metadata refuses
        reader = SafeFileSystemReader(str(tmp_path / "ckpt"))
        plant_metadata(tmp_path / "ckpt", marker)
        with pytest.raises(BaseException) as info:
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        assert type(info.value).__name__ == "CheckpointException"  # DCP gathers its planning's failures
        # torch 2.13 keeps the refusal's line in its "metadata is None" failure; torch 2.11 drops it
        assert "holds posix.system, which is not one of DCP's" in str(info.value) or "metadata is None" in str(
            info.value
        )
    else:
        plant_metadata(tmp_path / "ckpt", marker)
        with pytest.raises(UnsafeCheckpoint) as info:
            if how == "constructed":
                safe_load(target, tmp_path / "ckpt")
            else:
                reader = SafeFileSystemReader(str(tmp_path))  # another folder, then reset to the planted one
                dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), storage_reader=reader, no_dist=True)
        assert str(info.value) == (
            f"{tmp_path / 'ckpt' / '.metadata'} holds posix.system, which is not one of DCP's metadata types: "
            f'refused before it runs; {HOW}([...]) (docs/reliability.md, "Trust")'
        )
    assert not marker.exists()
    assert_same(target, template(state))


@pytest.mark.parametrize("reader", [SafeFileSystemReader, FileSystemReader], ids=["safe-reader", "dcp-reader"])
def test_a_planted_item_is_refused_before_it_runs_and_nothing_is_read(tmp_path, reader):
    """The item's pickle names ``os.system``: SafeLoadPlanner never unpickles it (with DCP's reader too); the safe
    reader checks every item before it reads a tensor, so the template keeps its zeros."""
    marker = tmp_path / "ran"
    state = {"a": torch.arange(6.0), "evil": RunsACommand(marker), "z": torch.ones(3)}
    save(tmp_path / "ckpt", state)
    target = {"a": torch.zeros(6), "evil": None, "z": torch.zeros(3)}
    with pytest.raises(
        BaseException, match=r"holds posix\.system, which torch\.load\(weights_only=True\) does"
    ) as info:
        dcp.load(target, storage_reader=reader(str(tmp_path / "ckpt")), planner=SafeLoadPlanner(), no_dist=True)
    assert f"{HOW}([...])" in str(info.value)
    assert not marker.exists()
    assert target["evil"] is None
    if reader is SafeFileSystemReader:
        assert "__0_0.distcp (item evil) holds" in str(info.value)
        assert torch.equal(target["a"], torch.zeros(6)) and torch.equal(target["z"], torch.zeros(3))


def test_a_type_the_user_allows_loads(tmp_path):
    state = {"t": torch.ones(2), "span": slice(1, 5)}
    save(tmp_path, state)
    target = {"t": torch.zeros(2), "span": None}
    with pytest.raises(BaseException, match=r"holds builtins\.slice"):
        safe_load(target, tmp_path)
    with torch.serialization.safe_globals([slice]):
        safe_load(target, tmp_path)
    assert target["span"] == slice(1, 5) and torch.equal(target["t"], torch.ones(2))


@pytest.mark.parametrize("relative", ["../other/__0_0.distcp", "/etc/passwd", "link.distcp"])
def test_a_storage_path_outside_the_folder_is_refused(tmp_path, relative):
    """Through ``..``, absolute, or a file of the folder that is a symbolic link to one outside it."""
    state = {"t": torch.ones(4)}
    save(tmp_path / "ckpt", state)
    save(tmp_path / "other", state)
    (tmp_path / "ckpt" / "link.distcp").symlink_to(tmp_path / "other" / "__0_0.distcp")
    move_storage(tmp_path / "ckpt", relative)
    target = {"t": torch.zeros(4)}
    with pytest.raises(UnsafeCheckpoint) as info:
        safe_load(target, tmp_path / "ckpt")
    assert str(info.value) == (
        f"{tmp_path / 'ckpt'}/.metadata names the storage path {relative!r}, outside the checkpoint's folder: refused"
    )
    assert torch.equal(target["t"], torch.zeros(4))


class _ShownAs:
    """Pickled as a ``PosixPath`` of ``parts`` whose state sets the text it shows: a path built from it would join
    ``parts`` while ``str()`` shows ``shown``."""

    def __init__(self, parts: tuple, shown: str) -> None:
        self.parts, self.shown = parts, shown

    def __reduce__(self):
        import pathlib

        return (pathlib.PosixPath, self.parts, (None, {"_str": self.shown}))


def test_a_pickled_path_is_read_as_its_text_never_built(tmp_path):
    """A ``checkpoint_id`` that was a path loads (DCP records it), and a storage path pickled as a path whose state
    would make its text differ from what it joins to is refused, the file outside the folder never read."""
    import pathlib

    state = {"t": torch.ones(4)}
    save(pathlib.Path(tmp_path / "ckpt"), state)  # DCP records the Path in StorageMeta.checkpoint_id
    target = {"t": torch.zeros(4)}
    safe_load(target, tmp_path / "ckpt")
    assert torch.equal(target["t"], torch.ones(4))
    (tmp_path / "outside").mkdir()
    (tmp_path / "ckpt" / "__0_0.distcp").rename(tmp_path / "outside" / "__0_0.distcp")
    move_storage(tmp_path / "ckpt", _ShownAs(("..", "outside", "__0_0.distcp"), "__0_0.distcp"))
    target = {"t": torch.zeros(4)}
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata is not DCP's metadata \(AttributeError: .*\): refused$"):
        safe_load(target, tmp_path / "ckpt")
    assert torch.equal(target["t"], torch.zeros(4))


def test_an_item_that_is_not_a_torch_save_archive_is_refused(tmp_path):
    import io

    from optim_factory.checkpoint._safe_read import check_item

    with pytest.raises(UnsafeCheckpoint, match=r"^item x is not a torch.save archive \("):
        check_item(io.BytesIO(b"not a zip"), "item x")
