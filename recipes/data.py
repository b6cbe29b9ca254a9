"""Data: an embedded synthetic task (multi-digit addition as characters) and flat uint16 token files.

Batches are a pure function of (seed, step, rank, world size): the global batch of a step is the same for any
world size, so resuming, and resharding between world sizes, replays exactly the same data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from recipes.config import DataConfig

ADDITION_VOCAB = "0123456789+=\n"


class DataError(ValueError):
    """A bad data config or data file: one line saying what is wrong."""


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


@dataclass
class AdditionTask:
    """Sequences like ``"07+45=052\\n07+..."``: two ``digits``-digit operands and their zero-padded sum."""

    digits: int
    seq_len: int
    batch_size: int
    seed: int

    @property
    def vocab_size(self) -> int:
        return len(ADDITION_VOCAB)

    def _sample(self, gen: torch.Generator, n: int) -> torch.Tensor:
        d = self.digits
        width = 2 * d + 2 + (d + 1) + 1  # a + b = c \n
        reps = (self.seq_len + 1) // width + 2
        hi = 10**d
        a = torch.randint(0, hi, (n, reps), generator=gen)
        b = torch.randint(0, hi, (n, reps), generator=gen)
        rows = []
        for i in range(n):
            text = "".join(f"{x:0{d}d}+{y:0{d}d}={x + y:0{d + 1}d}\n" for x, y in zip(a[i].tolist(), b[i].tolist()))
            start = int(torch.randint(0, width, (1,), generator=gen))
            rows.append([ADDITION_VOCAB.index(c) for c in text[start : start + self.seq_len + 1]])
        return torch.tensor(rows, dtype=torch.long)

    def batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = self._sample(_generator(self.seed, step), self.batch_size * world)
        mine = seqs[rank * self.batch_size : (rank + 1) * self.batch_size]
        return mine[:, :-1], mine[:, 1:]


@dataclass
class TokenFile:
    """Random windows of a flat little-endian uint16 token file (memory-mapped)."""

    path: str
    seq_len: int
    batch_size: int
    seed: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not self.path:
            raise DataError("data.path is required with data.kind=tokens (a flat uint16 token file)")
        if not os.path.isfile(self.path):
            raise DataError(f"data.path={self.path!r}: no such file")
        size = os.path.getsize(self.path)
        if size % 2:
            raise DataError(f"data.path={self.path!r}: {size} bytes is not a whole number of uint16 tokens")
        if size // 2 < self.seq_len + 1:
            raise DataError(
                f"data.path={self.path!r}: {size // 2} tokens, fewer than data.seq_len+1={self.seq_len + 1}"
            )
        self.tokens = np.memmap(self.path, dtype="<u2", mode="r")
        top = int(self.tokens.max())
        if top >= self.vocab_size:
            raise DataError(
                f"data.path={self.path!r}: token id {top} >= model.vocab_size={self.vocab_size}; raise model.vocab_size"
            )

    def batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = _generator(self.seed, step)
        n = self.batch_size * world
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (n,), generator=gen)
        starts = starts[rank * self.batch_size : (rank + 1) * self.batch_size].tolist()
        windows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
        seqs = torch.from_numpy(windows)
        return seqs[:, :-1], seqs[:, 1:]


def build_data(cfg: DataConfig, vocab_size: int) -> AdditionTask | TokenFile:
    """Validate the data config (and file) and return a batch source. Raises :class:`DataError`."""
    if cfg.seq_len < 1 or cfg.batch_size < 1:
        raise DataError(f"data.seq_len={cfg.seq_len}, data.batch_size={cfg.batch_size}: both must be >= 1")
    if cfg.kind == "addition":
        if not 1 <= cfg.digits <= 9:
            raise DataError(f"data.digits={cfg.digits}: expected 1..9")
        if vocab_size < len(ADDITION_VOCAB):
            raise DataError(f"model.vocab_size={vocab_size}: the addition task needs >= {len(ADDITION_VOCAB)}")
        return AdditionTask(cfg.digits, cfg.seq_len, cfg.batch_size, cfg.seed)
    if cfg.kind == "tokens":
        return TokenFile(cfg.path or "", cfg.seq_len, cfg.batch_size, cfg.seed, vocab_size)
    raise DataError(f"data.kind={cfg.kind!r}: expected addition|tokens")
