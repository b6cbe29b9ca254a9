"""Data: an embedded synthetic task (multi-digit addition as characters) and flat uint16 token files.

``data.global_batch_size`` is the batch of one optimizer step over all ranks. A step's global batch is a pure
function of (seed, step), sampled whole on every rank; rank r of w takes rows [r*n/w, (r+1)*n/w). The global
batch is therefore bitwise the same for any world size, and a resume on another number of ranks continues the
same run.

Held-out data, never trained on:

- addition: ``data.eval_size`` (a, b) operand pairs drawn once from the seed; training sampling redraws any
  pair that is one of them, so no training sequence contains a held-out sum.
- tokens: the last ``data.holdout_fraction`` of the file; training windows lie wholly before it and the
  ``data.eval_size`` evaluation windows, evenly spaced, wholly inside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from recipes.config import ADDITION_VOCAB, DataConfig, DataError, DataKind

__all__ = ["ADDITION_VOCAB", "AdditionTask", "DataError", "TokenFile", "build_data"]


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def rank_share(n: int, rank: int, world: int) -> slice:
    """Rows of rank ``rank`` in a global batch of ``n`` rows split evenly over ``world`` ranks."""
    per = n // world
    return slice(rank * per, (rank + 1) * per)


def eval_share(n: int, rank: int, world: int) -> slice:
    """Rows of rank ``rank`` in an evaluation set of ``n`` rows (every row on exactly one rank; shares may differ
    by one row, and be empty)."""
    return slice(rank, n, world)


def encode(text: str) -> list[int]:
    return [ADDITION_VOCAB.index(c) for c in text]


@dataclass
class AdditionTask:
    """Sequences like ``"07+45=052\\n07+..."``: two ``digits``-digit operands and their zero-padded sum.

    Every sequence starts at a problem, so the model meets problems at the positions where evaluation puts them
    (learned position embeddings: a problem at a position the model rarely saw it at in training is harder).
    """

    digits: int
    seq_len: int
    global_batch_size: int
    seed: int
    eval_size: int
    eval_pairs: torch.Tensor = field(init=False, repr=False)  # (eval_size, 2) held-out (a, b), never trained on

    def __post_init__(self) -> None:
        hi = 10**self.digits
        limit = hi * hi // 4
        if not 1 <= self.eval_size <= limit:
            raise DataError(
                f"data.eval_size={self.eval_size}: expected 1..{limit} held-out problems "
                f"(a quarter of the {hi * hi} operand pairs of data.digits={self.digits})"
            )
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 - 1)  # a stream no training step uses
        keys: dict[int, None] = {}
        while len(keys) < self.eval_size:
            for k in torch.randint(0, hi * hi, (2 * self.eval_size,), generator=gen).tolist():
                if len(keys) < self.eval_size:
                    keys.setdefault(k, None)
        k = torch.tensor(list(keys), dtype=torch.long)
        self.eval_pairs = torch.stack([k // hi, k % hi], dim=1)

    @property
    def vocab_size(self) -> int:
        return len(ADDITION_VOCAB)

    def is_held_out(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        hi = 10**self.digits
        held = self.eval_pairs[:, 0] * hi + self.eval_pairs[:, 1]
        return torch.isin(a * hi + b, held)

    def _operands(self, gen: torch.Generator, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniform operand pairs outside the held-out set (held-out pairs are redrawn, deterministically)."""
        hi = 10**self.digits
        a = torch.randint(0, hi, shape, generator=gen)
        b = torch.randint(0, hi, shape, generator=gen)
        held = self.is_held_out(a, b)
        while held.any():
            n = int(held.sum())
            a[held] = torch.randint(0, hi, (n,), generator=gen)
            b[held] = torch.randint(0, hi, (n,), generator=gen)
            held = self.is_held_out(a, b)
        return a, b

    def _sample(self, gen: torch.Generator, n: int) -> torch.Tensor:
        d = self.digits
        width = 2 * d + 2 + (d + 1) + 1  # a + b = c \n
        reps = (self.seq_len + 1) // width + 2
        a, b = self._operands(gen, (n, reps))
        rows = []
        for i in range(n):
            text = "".join(f"{x:0{d}d}+{y:0{d}d}={x + y:0{d + 1}d}\n" for x, y in zip(a[i].tolist(), b[i].tolist()))
            rows.append(encode(text[: self.seq_len + 1]))  # starts at a problem, as the eval prompts do
        return torch.tensor(rows, dtype=torch.long)

    def global_batch(self, step: int) -> torch.Tensor:
        """The ``(global_batch_size, seq_len + 1)`` sequences of ``step`` (the same for any world size)."""
        return self._sample(_generator(self.seed, step), self.global_batch_size)

    def batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self.global_batch(step)[rank_share(self.global_batch_size, rank, world)]
        return mine[:, :-1], mine[:, 1:]

    def eval_problems(self, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the held-out problems: prompts ``"aa+bb="`` and answers ``"ccc"`` as tokens."""
        d = self.digits
        pairs = self.eval_pairs[eval_share(self.eval_size, rank, world)].tolist()
        prompts = [encode(f"{a:0{d}d}+{b:0{d}d}=") for a, b in pairs]
        answers = [encode(f"{a + b:0{d + 1}d}") for a, b in pairs]
        return (
            torch.tensor(prompts, dtype=torch.long).reshape(len(pairs), 2 * d + 2),
            torch.tensor(answers, dtype=torch.long).reshape(len(pairs), d + 1),
        )


@dataclass
class TokenFile:
    """Random windows of a flat little-endian uint16 token file (memory-mapped), with an optional held-out tail."""

    path: str
    seq_len: int
    global_batch_size: int
    seed: int
    vocab_size: int
    holdout_fraction: float
    eval_size: int

    def __post_init__(self) -> None:
        size = os.path.getsize(self.path)
        if size % 2:
            raise DataError(f"data.path={self.path!r}: {size} bytes is not a whole number of uint16 tokens")
        n = size // 2
        held = int(n * self.holdout_fraction)
        self.split = n - held  # training windows end at or before this token; the held-out tail starts here
        if self.split < self.seq_len + 1:
            raise DataError(
                f"data.path={self.path!r}: {self.split} training tokens (of {n}, "
                f"data.holdout_fraction={self.holdout_fraction}), fewer than data.seq_len+1={self.seq_len + 1}"
            )
        if held and held - self.seq_len < self.eval_size:
            raise DataError(
                f"data.eval_size={self.eval_size}: the held-out tail (data.holdout_fraction={self.holdout_fraction}"
                f" of {n} tokens = {held}) has {max(0, held - self.seq_len)} windows of data.seq_len+1="
                f"{self.seq_len + 1} tokens; lower data.eval_size or raise data.holdout_fraction"
            )
        self.tokens = np.memmap(self.path, dtype="<u2", mode="r")
        top = int(self.tokens.max())
        if top >= self.vocab_size:
            raise DataError(
                f"data.path={self.path!r}: token id {top} >= model.vocab_size={self.vocab_size}; raise model.vocab_size"
            )

    @property
    def has_holdout(self) -> bool:
        return self.split < len(self.tokens)

    def _windows(self, starts: list[int]) -> torch.Tensor:
        windows = [np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(windows)) if windows else torch.empty(0, self.seq_len + 1, dtype=torch.long)

    def global_starts(self, step: int) -> torch.Tensor:
        """Start offsets of the global batch of ``step`` (the same for any world size)."""
        gen = _generator(self.seed, step)
        return torch.randint(0, self.split - self.seq_len, (self.global_batch_size,), generator=gen)

    def batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.global_starts(step)[rank_share(self.global_batch_size, rank, world)]
        seqs = self._windows(starts.tolist())
        return seqs[:, :-1], seqs[:, 1:]

    def eval_windows(self, rank: int, world: int) -> torch.Tensor:
        """This rank's share of the ``eval_size`` held-out windows (evenly spaced over the held-out tail)."""
        last = len(self.tokens) - self.seq_len - 1
        starts = torch.linspace(self.split, last, self.eval_size, dtype=torch.float64).round().long()
        return self._windows(starts[eval_share(self.eval_size, rank, world)].tolist())


def build_data(cfg: DataConfig | DictConfig, vocab_size: int, world_size: int) -> AdditionTask | TokenFile:
    """A batch source for ``world_size`` ranks from a data config (a ``DictConfig`` is converted to its schema,
    whose rules run then: :class:`recipes.config.DataConfig`); the rules about the world size and the file here.

    Raises :class:`DataError`.
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)
    if cfg.global_batch_size < 1 or cfg.global_batch_size % world_size:
        raise DataError(
            f"data.global_batch_size={cfg.global_batch_size}: must be a positive multiple of the world size "
            f"({world_size} ranks), each rank takes an equal share"
        )
    if cfg.kind == DataKind.addition:
        return AdditionTask(cfg.digits, cfg.seq_len, cfg.global_batch_size, cfg.seed, cfg.eval_size)
    return TokenFile(
        cfg.path, cfg.seq_len, cfg.global_batch_size, cfg.seed, vocab_size, cfg.holdout_fraction, cfg.eval_size
    )
