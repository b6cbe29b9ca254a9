"""What a resume does with a config that differs from the checkpoint's (docs/reliability.md, "Resume").

:data:`RESUME_RULES` is the one table: every config key that differs between the run and the checkpoint it
resumes (the resolved config is in the checkpoint's manifest) is

* ``config``: the config wins (hyperparameters; param groups are built from the config by parameter name and
  keep the config's values after the load), logged ``resume: optim.weight_decay 0.1 -> 0.0 (from the config)``;
* ``converted``: the state layout changes; the saved states are converted exactly as the optimizer's
  ``load_state_dict`` converts them, logged ``(converted)``;
* ``refused``: one :class:`ResumeRefused` line naming the key and both values, before anything is read into the
  model or optimizer;
* ``ignored``: operational keys (progress, threads, logging, device, checkpoint options, run_dir), not logged.

Keys of no row follow the config and are logged like ``config`` rows (e.g. ``trainer.max_steps``, ``data.*``).

The checkpoint manager calls :func:`check_config` before a load, :func:`align_template` on the state dict DCP
loads into (so that DCP never casts a saved tensor to another dtype on its own: it would truncate an FP32
master into int16 remainders), :func:`finish_masters` after DCP's read, and :func:`capture_hyperparameters` /
:func:`restore_hyperparameters` around ``set_state_dict`` (DCP's flattened optimizer state restores each
group's values from the checkpoint's value for the group's first parameter).
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from optim_factory.optimizers.export import join_bf16_remainder, local_tensor, split_bf16_remainder, wrap_host_local
from recipes.checkpoint import CheckpointError, read_manifest

log = logging.getLogger(__name__)

CONFIG, CONVERTED, REFUSED, IGNORED = "config", "converted", "refused", "ignored"
FOLLOWS = CONFIG  # keys of no row: the run's config applies (logged)


@dataclass(frozen=True)
class Rule:
    pattern: str  # fnmatch pattern over the dotted config key
    action: str  # CONFIG | CONVERTED | REFUSED | IGNORED
    why: str
    test: str  # the test in tests/recipe/test_resume.py that proves the row


T_HYPER_LOG = "tests/recipe/test_resume.py::test_hyperparameter_changes_are_logged_and_recorded"
T_REFUSED, T_HYPER, T_GROUPS, T_LAYOUT, T_ADAMW = (
    "test_refused_changes",
    "test_hyperparameters_follow_the_config",
    "test_no_decay_patterns_change_across_a_resume",
    "test_layout_converts",
    "test_adamw_group_keys_follow_the_config_or_are_refused",
)

# The first matching row applies. docs/reliability.md renders this table (tests check that it does).
RESUME_RULES: tuple[Rule, ...] = (
    Rule("optim.name", REFUSED, "the optimizer type (its state) cannot change", T_REFUSED),
    Rule("optim.capturable", REFUSED, "lr and step change representation", T_REFUSED),
    Rule(
        "checkpoint.flatten_optimizer_state_dict",
        REFUSED,
        "the optimizer state's key layout in the checkpoint changes",
        T_REFUSED,
    ),
    *(
        Rule(f"model.{k}", REFUSED, "the model's architecture or shapes change", T_REFUSED)
        for k in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len", "tie_embeddings", "dtype")
    ),
    Rule(
        "trainer.seed",
        REFUSED,
        "the weights and the random state are the checkpoint's: the seed only starts a new run",
        T_REFUSED,
    ),
    Rule(
        "optim.amsgrad",
        REFUSED,
        "AdamW's state gains or loses max_exp_avg_sq (True -> False would keep it, then fail)",
        T_ADAMW,
    ),
    *(
        Rule(f"optim.{k}", CONFIG, "hyperparameter: the config's value is used", T_HYPER)
        for k in ("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode")
    ),
    Rule("optim.foreach", CONFIG, "AdamW's implementation: the config's value is used", T_ADAMW),
    Rule(
        "optim.param_groups.*",
        CONFIG,
        "groups are built from the config by parameter name; moments are matched by name",
        T_GROUPS,
    ),
    *(
        Rule(f"optim.{k}", CONVERTED, "state dtype: converted on load", T_LAYOUT)
        for k in ("exp_avg_dtype", "exp_avg_sq_dtype")
    ),
    Rule("optim.master_weights", CONVERTED, "on: the master starts as the parameter; off: dropped", T_LAYOUT),
    Rule("optim.master_weight_dtype", CONVERTED, "the master is converted on load", T_LAYOUT),
    Rule("optim.store_param_remainders", CONVERTED, "FP32 master <-> int16 remainders, exactly", T_LAYOUT),
    Rule("optim.state_dict_*", CONVERTED, "export options: how checkpoints are written", T_LAYOUT),
    *(
        Rule(k, IGNORED, "operational", "")
        for k in (
            "run_dir",
            "checkpoint.*",
            *(f"trainer.{t}" for t in ("progress", "threads", "log_every", "device", "stop_at")),
        )
    ),
)


class ResumeRefused(CheckpointError):
    """The run's config cannot resume this checkpoint (never retried with an older checkpoint)."""

    older_may_load = False


@dataclass(frozen=True)
class Change:
    key: str
    checkpoint: Any
    config: Any
    action: str

    def line(self) -> str:
        how = "(converted)" if self.action == CONVERTED else "(from the config)"
        return f"resume: {self.key} {_show(self.checkpoint)} -> {_show(self.config)} {how}"

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl record of this change."""
        return {
            "kind": "resume",
            "key": self.key,
            "checkpoint": self.checkpoint,
            "config": self.config,
            "action": self.action,
        }


def _show(value: Any) -> str:
    return "absent" if value is _ABSENT else str(value)


_ABSENT = "<absent>"


def rule_for(key: str) -> Rule | None:
    return next((r for r in RESUME_RULES if fnmatch.fnmatchcase(key, r.pattern)), None)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys; Enum choices as their values (as the manifest's JSON stores them)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree.value if isinstance(tree, Enum) else tree}
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        flat.update(_flatten(v, f"{prefix}{k}."))
    return flat


def compare(saved: dict[str, Any], run: dict[str, Any]) -> list[Change]:
    """Every non-ignored key whose value differs between the checkpoint's config and the run's, in key order."""
    a, b = _flatten(saved), _flatten(run)
    changes = []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if old == new:
            continue
        rule = rule_for(key)
        action = rule.action if rule else FOLLOWS
        if action != IGNORED:
            changes.append(Change(key, old, new, action))
    return changes


def check_config(path: Path, run_config: dict[str, Any] | None) -> list[Change]:
    """Compare ``run_config`` with the config in checkpoint ``path``'s manifest: raise one :class:`ResumeRefused`
    line for a refused change, else return the changes (not yet logged). Reads only the manifest."""
    if run_config is None:
        return []
    saved = read_manifest(path).get("config")
    if not isinstance(saved, dict):
        log.warning(
            "checkpoint %s has no config in its manifest (written before it was recorded): resuming "
            "without comparing its config with this run's",
            path,
        )
        return []
    changes = compare(saved, run_config)
    refused = sorted((c for c in changes if c.action == REFUSED), key=lambda c: RESUME_RULES.index(rule_for(c.key)))
    if refused:
        first = refused[0]
        more = f" (also: {', '.join(c.key for c in refused[1:])})" if len(refused) > 1 else ""
        raise ResumeRefused(
            f"checkpoint {path} cannot be resumed with this config: {first.key} is {_show(first.checkpoint)} in "
            f"the checkpoint and {_show(first.config)} in the config ({rule_for(first.key).why}){more}; use a new "
            "run_dir to train with it"
        )
    return changes


@dataclass(frozen=True)
class MasterFixup:
    """A master whose saved form the optimizer cannot convert on its own (it sees the parameter before DCP's
    ``set_state_dict`` loads the model): ``missing`` (master weights turned on) or ``join`` (int16 remainders
    saved, a full master wanted)."""

    tree: dict  # the template dict that holds it
    key: str
    fqn: str  # the parameter's name: its key in the model state dict
    kind: str  # "missing" | "join" | "split"


_STATE, _MASTER = "optim.state.", ".master_param"


def align_template(state: dict[str, Any], path: Path) -> list[MasterFixup]:
    """Make the (host) state dict DCP loads ``path`` into match what the checkpoint holds, in place.

    A tensor saved with another dtype gets an empty template of the *saved* dtype, so DCP reads it unchanged and
    the optimizer's ``load_state_dict`` converts it (FP32 master -> int16 remainders, BF16 <-> FP32 moments ...):
    DCP itself would ``copy_`` it into the template's dtype (an FP32 master into int16: truncated garbage). A
    ``master_param`` the checkpoint lacks (master weights turned on) is taken out of what DCP reads. Both, and
    saved int16 remainders where a full master is wanted, are returned for :func:`finish_masters`. Any other
    tensor the checkpoint lacks is one ``CheckpointError`` line naming the key.
    """
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    fixups: list[MasterFixup] = []

    def walk(tree: dict, prefix: str) -> None:
        for k in list(tree):
            key, value = f"{prefix}{k}", tree[k]
            if isinstance(value, dict):
                walk(value, f"{key}.")
                continue
            if not isinstance(value, torch.Tensor):
                continue
            is_master = key.startswith(_STATE) and key.endswith(_MASTER)
            fqn = key[len(_STATE) : -len(_MASTER)] if is_master else ""
            meta = saved.get(key)
            if meta is None:
                if not is_master:
                    raise CheckpointError(  # DCP's own wording, in one line, before it reads anything
                        f"checkpoint {path} cannot be loaded into this run: Missing key in checkpoint state_dict: {key}"
                    )
                fixups.append(MasterFixup(tree, k, fqn, "missing"))
                del tree[k]
                continue
            dtype = getattr(getattr(meta, "properties", None), "dtype", None)
            if dtype is not None and dtype != value.dtype:
                if is_master and dtype == torch.int16:
                    fixups.append(MasterFixup(tree, k, fqn, "join"))
                elif is_master and value.dtype == torch.int16:  # an FP32 master saved, int16 remainders wanted
                    fixups.append(MasterFixup(tree, k, fqn, "split"))
                local = torch.empty(local_tensor(value).shape, dtype=dtype)
                tree[k] = wrap_host_local(local, value) if isinstance(value, DTensor) else local

    walk(state, "")
    return fixups


def finish_masters(state: dict[str, Any], fixups: list[MasterFixup]) -> None:
    """After DCP's read: each master of ``fixups`` as the full FP32 master, from the *loaded* parameter (exact):
    a missing master is the parameter widened; int16 remainders are joined with it. The optimizer's load then
    converts it as it converts any saved FP32 master (to an FP16 master ...). ``split``: a saved FP32 master where
    int16 remainders are wanted becomes the parameter (the master rounded as the remainder kernels round, which
    differs from a plain BF16 rounding at ties) and the remainders, so that the two rejoin the saved master
    exactly (the model is loaded after the optimizer, so the parameter is set here, in what the model loads)."""
    for f in fixups:
        param = state["model"][f.fqn]
        local = local_tensor(param)
        if f.kind == "split":
            master = local_tensor(f.tree[f.key]).float()
            remainders = torch.empty(master.shape, dtype=torch.int16)
            split_bf16_remainder(master, local, remainders)  # writes the rounded parameter into the model's tree
            f.tree[f.key] = wrap_host_local(remainders, param) if isinstance(param, DTensor) else remainders
            continue
        if f.kind == "join":
            value = join_bf16_remainder(local, local_tensor(f.tree[f.key]))
        else:
            value = local.float()
        f.tree[f.key] = wrap_host_local(value, param) if isinstance(param, DTensor) else value


# the group values the config sets (DCP's load puts the checkpoint's back; restore_hyperparameters undoes that):
# FusedAdam's, and AdamW's foreach (without it in this list the checkpoint's value stays)
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "foreach")


def capture_hyperparameters(optimizer: torch.optim.Optimizer) -> list[tuple[list, dict[str, Any]]]:
    """Each group's parameters and hyperparameters as the config built them (before a load replaces them)."""
    return [
        (
            list(g["params"]),
            {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k in HYPERPARAMETERS},
        )
        for g in optimizer.param_groups
    ]


def restore_hyperparameters(optimizer: torch.optim.Optimizer, captured: list[tuple[list, dict[str, Any]]]) -> None:
    """Put the config's hyperparameters back into each group (after a load); the groups keep their parameters."""
    if len(captured) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the load changed the optimizer's groups ({len(captured)} -> {len(optimizer.param_groups)})"
        )
    for group, (params, values) in zip(optimizer.param_groups, captured):
        if [id(p) for p in group["params"]] != [id(p) for p in params]:
            raise CheckpointError("the load changed the parameters of an optimizer group")
        for k, v in values.items():
            if isinstance(v, torch.Tensor) and isinstance(group.get(k), torch.Tensor):
                group[k].copy_(v)
            else:
                group[k] = v


def log_changes(changes: list[Change]) -> None:
    for c in changes:
        log.info(c.line())


def nothing_to_do(
    step: int, end: int, path: str | None, changes: list[Change], limit: str = "trainer.max_steps"
) -> str:
    """The line for a run that has nothing left to train: plain, or (the refusal) naming what differs from the
    checkpoint, which would take effect in no step. ``limit``: the key whose value ``end`` is (``trainer.stop_at``
    when it ends the run before ``trainer.max_steps``): the one to raise."""
    if not changes:
        return f"nothing to do: checkpoint step {step} >= {end} (to train on, raise {limit})"
    diff = ", ".join(f"{c.key} {_show(c.checkpoint)} -> {_show(c.config)}" for c in changes)
    return (
        f"run finished at step {step}: the config differs from checkpoint {Path(path).name}'s ({diff}) but no step "
        f"is left to train ({limit}={end}); raise {limit} above {step} or use a new run_dir"
    )


def markdown_table() -> str:
    """:data:`RESUME_RULES` as the Markdown table docs/reliability.md shows (a test keeps them equal)."""
    what = {CONFIG: "the config wins", CONVERTED: "converted", REFUSED: "refused", IGNORED: "ignored (operational)"}
    rows = ["| key | on resume | why | test |", "|---|---|---|---|"]
    for r in RESUME_RULES:
        test = f"`tests/recipe/test_resume.py::{r.test}`" if r.test else ""
        rows.append(f"| `{r.pattern}` | {what[r.action]} | {r.why} | {test} |")
    rows.append(f"| any other key (`trainer.*`, `data.*`, ...) | the config wins | logged | `{T_HYPER_LOG}` |")
    return "\n".join(rows)
