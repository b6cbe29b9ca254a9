"""Evaluation on held-out data (see recipes/data.py for how it is held out).

- addition: exact-match accuracy of the answer digits decoded greedily after the prompt ``"aa+bb="`` (one
  forward pass per answer digit, no cache), and the mean cross-entropy of the answer digits given the prompt
  and the true earlier digits (``eval_loss``).
- tokens: the mean cross-entropy of every next token of the held-out windows (``eval_loss``).

Each rank evaluates its share of the held-out set and the sums are all-reduced, so every rank returns the
same result. Every rank makes the same number of forward calls (FSDP2 gathers parameters in them), also
with an empty share.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from recipes.data import AdditionTask, DataError, TokenFile


def check_eval_config(trainer, data: AdditionTask | TokenFile) -> None:
    """Raises :class:`DataError` for an ``eval_every`` that cannot take effect with this token file (the rules of
    the config alone: :class:`recipes.config.TrainConfig`)."""
    if trainer.eval_every > 0 and isinstance(data, TokenFile) and not data.has_holdout:
        raise DataError(
            f"trainer.eval_every={trainer.eval_every} needs a held-out split: set data.holdout_fraction "
            "(e.g. 0.01), or trainer.eval_every=0"
        )


def _token_losses(model: torch.nn.Module, seqs: torch.Tensor, first: int) -> torch.Tensor:
    """Cross-entropy (summed, fp32) of the tokens ``seqs[:, first:]``, each predicted from those before it."""
    logits = model(seqs[:, :-1])[:, first - 1 :]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), seqs[:, first:].reshape(-1), reduction="sum")


def _addition_sums(model, data: AdditionTask, rank: int, world: int, device) -> list[float]:
    prompts, answers = data.eval_problems(rank, world)
    prompts, answers = prompts.to(device), answers.to(device)
    loss_sum = _token_losses(model, torch.cat([prompts, answers], dim=1), prompts.shape[1])
    seq = prompts
    for _ in range(answers.shape[1]):
        nxt = model(seq)[:, -1].argmax(dim=-1)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
    correct = (seq[:, prompts.shape[1] :] == answers).all(dim=1).sum()
    return [float(loss_sum), answers.numel(), float(correct), len(answers)]


def _token_sums(model, data: TokenFile, rank: int, world: int, device) -> list[float]:
    seqs = data.eval_windows(rank, world).to(device)
    return [float(_token_losses(model, seqs, 1)), seqs[:, 1:].numel(), 0.0, len(seqs)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: AdditionTask | TokenFile, rank: int, world: int, device) -> dict:
    """Evaluate on the held-out set (call on every rank); returns ``eval_loss``, ``accuracy`` (addition only),
    ``eval_examples`` and ``eval_s`` (wall time)."""
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        sums = (_addition_sums if isinstance(data, AdditionTask) else _token_sums)(model, data, rank, world, device)
    finally:
        model.train(was_training)
        for module in model.modules():  # without a backward, FSDP2 leaves the root's parameters unsharded
            if isinstance(module, FSDPModule):
                module.reshard()
    totals = torch.tensor(sums, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(totals)  # CPU tensor: gloo (cpu:gloo,cuda:nccl on CUDA)
    loss_sum, tokens, correct, examples = totals.tolist()
    result = {"eval_loss": loss_sum / tokens, "eval_examples": int(examples)}
    if isinstance(data, AdditionTask):
        result["accuracy"] = correct / examples
    result["eval_s"] = time.perf_counter() - t0
    return result
