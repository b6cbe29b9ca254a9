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

The load (recipes/checkpoint/load.py) calls :func:`check_config` before it reads anything; the conversions are
its own (the masters DCP cannot convert, the hyperparameters put back after ``set_state_dict``).
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from optim_factory.tree import leaves
from recipes.checkpoint.layout import CheckpointError

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
    no_effect: str | None = None  # why the new value changes nothing in this run (:func:`moot`), else None

    def line(self) -> str:
        if self.no_effect is not None:
            return f"resume: {self.key} {_show(self.checkpoint)} -> {_show(self.config)}: no effect ({self.no_effect})"
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


def _flatten(tree: Any) -> dict[str, Any]:
    """Dotted keys; Enum choices as their values (as the manifest's JSON stores them)."""
    return {".".join(keys): v.value if isinstance(v, Enum) else v for keys, v in leaves(tree, dicts_only=True)}


def moot(key: str, run: dict[str, Any]) -> str | None:
    """Why ``key``'s value changes nothing in a run of (flattened) config ``run``, or None: the master's format
    without a master, remainders without an FP32 master of BF16 parameters (TE's rule)."""
    if key not in ("optim.store_param_remainders", "optim.master_weight_dtype"):
        return None
    if run.get("optim.master_weights") is False:
        return "optim.master_weights=false: no master is kept"
    if key == "optim.store_param_remainders" and run.get("optim.master_weight_dtype") not in (None, "fp32"):
        return f"optim.master_weight_dtype={run['optim.master_weight_dtype']}: remainders need an FP32 master"
    if key == "optim.store_param_remainders" and run.get("model.dtype") not in (None, "bf16"):
        return f"model.dtype={run['model.dtype']}: remainders apply to BF16 parameters only"
    return None


def compare(saved: dict[str, Any], run: dict[str, Any]) -> list[Change]:
    """Every non-ignored key whose value differs between the checkpoint's config and the run's, in key order
    (with why it changes nothing in this run, where it does not: :func:`moot`)."""
    a, b = _flatten(saved), _flatten(run)
    changes = []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if old == new:
            continue
        rule = rule_for(key)
        action = rule.action if rule else FOLLOWS
        if action != IGNORED:
            changes.append(Change(key, old, new, action, moot(key, b)))
    return changes


def check_config(path: Path, manifest: dict[str, Any], run_config: dict[str, Any] | None) -> list[Change]:
    """Compare ``run_config`` with the config in checkpoint ``path``'s ``manifest`` (``layout.read_manifest``'s):
    raise one :class:`ResumeRefused` line for a refused change, else return the changes (not yet logged)."""
    if run_config is None:
        return []
    saved = manifest.get("config")
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


def log_changes(changes: list[Change], typed: list[str] | None = None) -> None:
    """Each change in one line: INFO, or WARNING where the config's value is used or converted to for a key this
    launch's command line does not set (``typed``: the keys it sets, each with the keys under it; None where
    unknown: every line INFO): an override of an earlier launch that this one left off, which reverts without a
    word of the user's (a dropped ``experiment=lowmem`` converts the optimizer's states back to FP32). A change
    that has no effect in this run says why, at INFO, with no advice to keep the checkpoint's value."""
    for c in changes:
        said = typed is None or any(c.key == k or c.key.startswith(k + ".") for k in typed)
        if c.action in (CONFIG, CONVERTED) and c.checkpoint is not _ABSENT and not said and c.no_effect is None:
            log.warning(
                "%s: this launch does not set %s (add %s=%s to keep the checkpoint's)",
                c.line(),
                c.key,
                c.key,
                _override_value(c.checkpoint),
            )
        else:
            log.info(c.line())


def _override_value(value: Any) -> str:
    """``value`` as a command-line override writes it (Hydra's grammar: ``null``, ``[a,b]``)."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


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


def no_room(space: str, path: Path | None) -> str:
    """The refusal of a launch whose next save cannot fit (``space``: the save's line), before its first step:
    resuming from ``path``, or a fresh run's first save (None)."""
    if path is None:
        return (
            f"not training: no room for the run's first checkpoint ({space}); free space there, or give another "
            "checkpoint.dir"
        )
    return (
        f"not resuming from {path}: no room for the run's next checkpoint ({space}); free space there, or give "
        "another checkpoint.dir with checkpoint.resume=<this checkpoint>"
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
