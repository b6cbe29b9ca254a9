"""recipes/data.py: one global batch for any world size, held-out data never trained on, config errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from recipes.data import ADDITION_VOCAB, AdditionTask, DataError, TokenFile, build_data
from recipes.job import train
from recipes.train import compose_config
from tests.recipe.runs import QUICK, metrics, snapshot


def _data_cfg(*overrides: str):
    return compose_config(list(overrides)).data


@pytest.fixture
def token_path(tmp_path):
    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 16, 5000).astype("<u2").tofile(path)
    return path


def _sources(token_path):
    addition = build_data(_data_cfg("data.global_batch_size=8"), 16, 1)
    tokens = build_data(
        _data_cfg(
            "data=tokens", f"data.path={token_path}", "data.seq_len=16", "data.global_batch_size=8", "data.eval_size=8"
        ),
        16,
        1,
    )
    return {"addition": addition, "tokens": tokens}


@pytest.mark.parametrize("kind", ["addition", "tokens"])
def test_global_batch_is_bitwise_the_same_on_1_2_4_ranks(kind, token_path):
    data = _sources(token_path)[kind]
    for step in (0, 1, 37):
        whole_in, whole_tg = data.batch(step, 0, 1)
        assert whole_in.shape[0] == 8
        for world in (2, 4):
            shares = [data.batch(step, r, world) for r in range(world)]
            assert all(s[0].shape[0] == 8 // world for s in shares)
            assert torch.equal(torch.cat([s[0] for s in shares]), whole_in), (kind, step, world)
            assert torch.equal(torch.cat([s[1] for s in shares]), whole_tg), (kind, step, world)
    assert not torch.equal(data.batch(0, 0, 1)[0], data.batch(1, 0, 1)[0])  # steps differ


def test_batch_size_that_does_not_divide_by_the_world_size_is_one_error():
    with pytest.raises(DataError) as info:
        build_data(_data_cfg("data.global_batch_size=64"), 16, 3)
    assert str(info.value) == (
        "data.global_batch_size=64: must be a positive multiple of the world size (3 ranks), each rank takes an "
        "equal share"
    )
    build_data(_data_cfg("data.global_batch_size=63"), 16, 3)


def test_indivisible_batch_fails_in_preflight_before_the_process_group(tmp_path, monkeypatch):
    """The world size comes from the launcher's environment, before any process group or model exists."""
    for key, value in dict(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    cfg = compose_config([*QUICK, f"run_dir={run_dir}"])
    batch = cfg.data.global_batch_size
    with pytest.raises(DataError, match=rf"data.global_batch_size={batch}: must be a positive multiple .* \(3 ranks\)"):
        train(cfg)
    assert not dist.is_initialized() and not run_dir.exists()


def _training_pairs(task: AdditionTask, steps: int) -> set[tuple[int, int]]:
    d = task.digits
    pattern = re.compile(rf"(\d{{{d}}})\+(\d{{{d}}})=")
    pairs: set[tuple[int, int]] = set()
    for step in range(steps):
        for row in task.global_batch(step).tolist():
            text = "".join(ADDITION_VOCAB[t] for t in row)
            pairs.update((int(a), int(b)) for a, b in pattern.findall(text))
    return pairs


def test_held_out_sums_never_appear_in_training():
    task = build_data(_data_cfg(), 16, 1)
    held = {tuple(p) for p in task.eval_pairs.tolist()}
    assert len(held) == task.eval_size == 256  # distinct
    seen = _training_pairs(task, 3840 // task.global_batch_size)  # 3,840 sequences
    assert len(seen) > 5000  # of the 10,000 pairs: without the exclusion about 2.5 % of these would be held out
    assert not seen & held
    again = build_data(_data_cfg(), 16, 1)
    assert torch.equal(again.eval_pairs, task.eval_pairs)  # fixed by the seed
    other = build_data(_data_cfg("data.seed=7"), 16, 1)
    assert not torch.equal(other.eval_pairs, task.eval_pairs)


def test_eval_problems_split_over_ranks_cover_the_set_once():
    task = build_data(_data_cfg("data.eval_size=7"), 16, 1)
    prompts, answers = task.eval_problems(0, 1)
    assert prompts.shape == (7, 6) and answers.shape == (7, 3)
    text = ["".join(ADDITION_VOCAB[t] for t in p + a) for p, a in zip(prompts.tolist(), answers.tolist())]
    for line in text:
        a, b, c = re.fullmatch(r"(\d\d)\+(\d\d)=(\d\d\d)", line).groups()
        assert int(a) + int(b) == int(c)
    for world in (2, 3, 4, 8):
        shares = [task.eval_problems(r, world) for r in range(world)]
        got = sorted(map(tuple, torch.cat([torch.cat(s, dim=1) for s in shares]).tolist()))
        assert got == sorted(map(tuple, torch.cat([prompts, answers], dim=1).tolist())), world


def test_token_file_holdout_split(token_path):
    cfg = _data_cfg(
        "data=tokens", f"data.path={token_path}", "data.seq_len=16", "data.holdout_fraction=0.1", "data.eval_size=20"
    )
    data = build_data(cfg, 16, 1)
    assert isinstance(data, TokenFile) and data.split == 4500 and data.has_holdout
    for step in range(200):
        starts = data.global_starts(step)
        assert int(starts.max()) + 17 <= 4500  # every training window ends before the held-out tail
    windows = data.eval_windows(0, 1)
    assert windows.shape == (20, 17)
    tokens = torch.from_numpy(np.fromfile(token_path, dtype="<u2").astype(np.int64))
    tail_starts = [s for s in range(4500, 5000 - 16)]
    for w in windows:  # each evaluation window is a window of the held-out tail
        assert any(torch.equal(w, tokens[s : s + 17]) for s in tail_starts)
    shares = torch.cat([data.eval_windows(r, 3) for r in range(3)])
    assert sorted(map(tuple, shares.tolist())) == sorted(map(tuple, windows.tolist()))


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["data.holdout_fraction=0.1"], "data.holdout_fraction=0.1: only for data.kind=tokens"),
        (["data.eval_size=0"], "data.eval_size=0: expected 1..2500 held-out problems"),
        (["data.digits=1", "data.eval_size=26"], "data.eval_size=26: expected 1..25 held-out problems"),
        (["data.global_batch_size=0"], "data.global_batch_size=0: must be a positive multiple"),
        (["data=tokens", "data.path=TOKENS", "data.holdout_fraction=0.6"], "data.holdout_fraction=0.6: expected 0"),
        (
            ["data=tokens", "data.path=TOKENS", "data.seq_len=16", "data.eval_size=100"],
            "data.eval_size=100: the held-out tail (data.holdout_fraction=0.01 of 5000 tokens = 50) has 34 windows",
        ),
        (
            ["data=tokens", "data.path=TOKENS", "data.holdout_fraction=0.5", "data.seq_len=4999"],
            "2500 training tokens (of 5000, data.holdout_fraction=0.5), fewer than data.seq_len+1=5000",
        ),
    ],
)
def test_bad_data_config_is_one_line(overrides, fragment, token_path):
    cfg = _data_cfg(*(o.replace("TOKENS", str(token_path)) for o in overrides))
    with pytest.raises(DataError) as info:
        build_data(cfg, 16, 1)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_token_eval_without_holdout_is_refused_or_off(tmp_path, token_path):
    over = [*QUICK, f"run_dir={tmp_path}", "data=tokens", f"data.path={token_path}", "data.seq_len=16"]
    with pytest.raises(DataError, match=r"trainer.eval_every=250 needs a held-out split: set data.holdout_fraction"):
        train(compose_config([*over, "data.holdout_fraction=0"]))
    before = snapshot(tmp_path)
    summary = train(compose_config([*over, "data.holdout_fraction=0", "trainer.eval_every=0", "trainer.max_steps=2"]))
    assert summary["eval"] is None and snapshot(tmp_path) != before
    assert not [r for r in metrics(tmp_path) if r["kind"] == "eval"]
