"""The recipe's config: schemas of its groups (model, data, checkpoint, trainer) registered in Hydra's ConfigStore,
each with its own rules (``__post_init__``; those across groups: ``TrainConfig.check``), and the check of a
composed config's keys (the command line and Hydra's errors: recipes/command_line.py).

The schemas hold every default; the YAML files under ``conf/`` hold only what differs (tested). With the schemas,
an unknown key, a wrongly typed value or a choice outside its Enum fails when Hydra composes the config, before
any work; ``recipes.command_line.config_error_line`` turns any such error into the one line the recipe prints.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from optim_factory.config import OPTIM_SCHEMAS, Choice, schema_keys, unknown_key_line
from optim_factory.config import register_configs as register_optim_configs
from optim_factory.errors import ConfigError

ADDITION_VOCAB = "0123456789+=\n"


CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "conf")  # conf/train.yaml and its groups


class DataError(ValueError):
    """A bad data config or data file: one line saying what is wrong."""


class CheckpointError(RuntimeError):
    """A checkpoint problem, in one line naming the checkpoint (or key) and what is wrong (raised by the checkpoint
    config's own rules here, and by ``recipes.checkpoint``)."""

    older_may_load = True  # with checkpoint.fallback, an older checkpoint is tried (not for a refused config)


class ModelDtype(Choice):
    """Parameter dtype (``bf16`` pairs with ``optim.master_weights=true``)."""

    fp32 = "fp32"
    bf16 = "bf16"


class DataKind(Choice):
    """``addition``: the embedded synthetic task; ``tokens``: a flat uint16 token file (``data.path``)."""

    addition = "addition"
    tokens = "tokens"


class Device(Choice):
    """``auto``: CUDA when available, else CPU."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class ModelConfig:
    vocab_size: int = 16
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_seq_len: int = 64
    dtype: ModelDtype = ModelDtype.fp32  # parameter dtype
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key}", getattr(self, key), "must be >= 1")
        if self.d_model % self.n_heads:
            raise ConfigError("model.d_model", self.d_model, f"must be divisible by model.n_heads={self.n_heads}")


@dataclass
class DataConfig:
    kind: DataKind = DataKind.addition
    seq_len: int = 24
    digits: int = 2  # addition: operands have this many digits
    path: str | None = None  # tokens: flat little-endian uint16 token file
    global_batch_size: int = 32  # sequences per optimizer step over all ranks (each rank takes an equal share)
    seed: int = 1234
    eval_size: int = 256  # held-out examples per evaluation (addition: problems never trained on; tokens: windows)
    holdout_fraction: float = 0.0  # tokens: the file's last fraction, never trained on, evaluated (0: none)

    def __post_init__(self) -> None:
        """The rules of the data config alone (the world size and the file: ``recipes.data.build_data``)."""
        if self.seq_len < 1:
            raise DataError(f"data.seq_len={self.seq_len}: must be >= 1")
        if self.kind == DataKind.addition:
            if not 1 <= self.digits <= 9:
                raise DataError(f"data.digits={self.digits}: expected 1..9")
            if self.holdout_fraction != 0:
                raise DataError(
                    f"data.holdout_fraction={self.holdout_fraction}: only for data.kind=tokens; the addition task "
                    "holds out data.eval_size problems"
                )
            if self.path is not None:
                raise DataError(f"data.path={self.path!r}: only for data=tokens (add data=tokens to train on the file)")
            return
        if self.digits != DataConfig.digits:
            raise DataError(f"data.digits={self.digits}: only for the addition task (data=addition)")
        if not 0 <= self.holdout_fraction <= 0.5:
            raise DataError(f"data.holdout_fraction={self.holdout_fraction}: expected 0 (no held-out split) .. 0.5")
        if self.eval_size < 1:
            raise DataError(f"data.eval_size={self.eval_size}: must be >= 1")
        if not self.path:
            raise DataError("data.path is required with data.kind=tokens (a flat uint16 token file)")
        if not os.path.isfile(self.path):
            raise DataError(f"data.path={self.path!r}: no such file")


@dataclass
class CheckpointConfig:
    dir: str = "${run_dir}/checkpoints"
    every_steps: int = 250
    keep_last: int = 3  # 0: keep all; deletes only older complete checkpoints
    async_save: bool = False  # dcp.async_save; the previous save is awaited before the next and at exit
    flatten_optimizer_state_dict: bool = True  # StateDictOptions(flatten_optimizer_state_dict=...)
    resume: str = "auto"  # auto (newest complete checkpoint) | never | <path of a step_* directory>
    fallback: bool = False  # resume=auto: if the newest complete checkpoint fails to load, try older ones
    write_threads: int = 0  # DCP writer threads per rank, one file each; 0: recipes.checkpoint.checksums.writer_threads
    key_env: str = ""  # the environment variable holding a key that signs checkpoints and verifies them before a load
    write_in_process: bool = False  # async saves written by a process of each rank's own (docs/export.md)
    enabled: bool = True

    def __post_init__(self) -> None:
        """The rules of the checkpoint config alone (the directory and a given path: ``recipes.preflight``)."""
        if self.every_steps < 1:
            raise CheckpointError(f"checkpoint.every_steps={self.every_steps}: must be >= 1")
        if self.keep_last < 0:
            raise CheckpointError(f"checkpoint.keep_last={self.keep_last}: must be >= 0 (0 keeps all)")
        if self.write_threads < 0:
            raise CheckpointError(f"checkpoint.write_threads={self.write_threads}: must be >= 0 (0: automatic)")
        if self.write_in_process and not self.async_save:  # a sync save is written while the loop waits, here
            raise CheckpointError(
                "checkpoint.write_in_process=true: writes async saves; set checkpoint.async_save=true (a synchronous "
                "save is written while the loop waits for it, in the training process)"
            )
        if self.key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.key_env):  # never echo: it may be a key
            raise CheckpointError(
                "checkpoint.key_env: expected the name of an environment variable (letters, digits, _), which holds "
                "the key: checkpoint.key_env=NAME, not its value"
            )
        if not self.enabled and self.resume not in ("auto", "never"):  # nothing would read it
            raise CheckpointError(
                f"checkpoint.resume={self.resume!r} with checkpoint.enabled=false: nothing would be loaded; "
                "drop checkpoint.resume, or set checkpoint.enabled=true"
            )
        if self.enabled and not str(self.dir).strip():  # Path('') is the current directory
            raise CheckpointError(
                f"checkpoint.dir={self.dir!r}: empty; expected a directory (e.g. <run_dir>/checkpoints)"
            )


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    stop_at: int = 0  # >0: stop after this step (checkpointed) as an interrupted job would; schedule follows max_steps
    warmup_steps: int = 30
    grad_clip: float = 1.0  # 0: off
    log_every: int = 25
    eval_every: int = 250  # evaluate the held-out data every N steps and at the end; 0: never
    seed: int = 0
    device: Device = Device.auto
    progress: bool | None = None  # a tqdm bar on rank 0; null: when stderr is a terminal
    threads: int = 0  # torch intra-op threads on CPU; 0: torch's default

    def __post_init__(self) -> None:
        for key, low in (("max_steps", 1), ("log_every", 1), ("warmup_steps", 0), ("threads", 0), ("grad_clip", 0)):
            if not getattr(self, key) >= low:  # also refuses NaN
                raise ConfigError(f"trainer.{key}", getattr(self, key), f"must be >= {low}")
        if not 0 <= self.stop_at <= self.max_steps:  # beyond max_steps it would stop nothing
            between = f"must be between 0 (off) and trainer.max_steps={self.max_steps}"
            raise ConfigError("trainer.stop_at", self.stop_at, between)
        if self.eval_every < 0:
            raise DataError(f"trainer.eval_every={self.eval_every}: must be >= 0 (0: no evaluation)")


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"  # metrics.jsonl, train.log, checkpoints/ (the same run_dir again resumes)
    optim: Any = None  # a schema of optim_factory.config.OPTIM_SCHEMAS, picked by the optim group
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def check(self) -> None:
        """The rules across groups (each group's own rules ran when it was built: ``__post_init__``). The preflight
        calls it once the data's file is read (``recipes.preflight``)."""
        if not str(self.run_dir).strip():  # Path('') is the current directory, and ${run_dir}/checkpoints the root's
            raise ConfigError("run_dir", self.run_dir, "empty; expected a directory (e.g. run_dir=runs/my_run)")
        model, data, trainer = self.model, self.data, self.trainer
        if data.kind == DataKind.addition:
            if model.vocab_size < len(ADDITION_VOCAB):
                raise DataError(
                    f"model.vocab_size={model.vocab_size}: the addition task needs >= {len(ADDITION_VOCAB)}"
                )
            positions = 3 * data.digits + 2  # an evaluation's prompt and all but the last answer token
            if trainer.eval_every > 0 and positions > model.max_seq_len:
                # else an IndexError in the position embedding at the first evaluation, after training
                raise DataError(
                    f"trainer.eval_every={trainer.eval_every} with data.digits={data.digits}: an evaluation feeds "
                    f"{positions} positions (3 * digits + 2), model.max_seq_len={model.max_seq_len}; raise "
                    "model.max_seq_len, lower data.digits, or set trainer.eval_every=0"
                )
        if data.seq_len > model.max_seq_len:
            raise ConfigError("data.seq_len", data.seq_len, f"must be <= model.max_seq_len={model.max_seq_len}")


GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "trainer": TrainerConfig,
}


def register_configs() -> None:
    """Register the recipe's and the optimizer's schemas (call before Hydra composes ``conf/train.yaml``)."""
    register_optim_configs()
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, schema in GROUP_SCHEMAS.items():  # at the root: a schema is not an option of its group
        cs.store(name=f"{group}_schema", node=schema)


# ------------------------------------------------------------------------------------------ checks, messages
def known_keys(optim_schema: type | None = None) -> list[str]:
    """Every valid dotted key of the recipe's config (the optim keys of ``optim_schema``, or of every schema)."""
    schemas = [optim_schema] if optim_schema else list(OPTIM_SCHEMAS.values())
    optim = {k for s in schemas for k in schema_keys(s, "optim.")}
    return schema_keys(TrainConfig) + sorted(optim)


def _unknown_keys(node: Any, prefix: str) -> list[str]:
    if isinstance(node, ListConfig):
        return [k for i, item in enumerate(node) for k in _unknown_keys(item, f"{prefix}[{i}]")]
    if not isinstance(node, DictConfig):
        return []
    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    found = []
    for key in node.keys():
        path = f"{prefix}.{key}" if prefix else str(key)
        if fields is not None and key not in fields:
            found.append(path)
        else:
            found += _unknown_keys(node[key], path)
    return found


def check_config(cfg: DictConfig) -> None:
    """Refuse a missing value (``???``) and any key not in the schemas, also keys added with Hydra's ``+``.

    Raises:
        ConfigError: one line naming the key (and the nearest valid key).
    """
    missing = OmegaConf.missing_keys(cfg)
    if missing:  # the outermost first: checkpoint.dir (${run_dir}/checkpoints) is missing when run_dir is
        key = min(missing, key=lambda k: (k.count("."), k))
        raise ConfigError(f"{key}: missing value (it has no default; set {key}=...)")
    unknown = _unknown_keys(cfg, "")
    optim_schema = OmegaConf.get_type(cfg.optim) if isinstance(cfg.get("optim"), DictConfig) else None
    if unknown:
        key, known = unknown[0], known_keys(optim_schema)
        raise ConfigError(another_optimizers_line(key, optim_schema) or unknown_key_line(key, known))
    name = cfg.optim.get("name") if optim_schema in OPTIM_SCHEMAS.values() else None
    if name in OPTIM_SCHEMAS and OPTIM_SCHEMAS[name] is not optim_schema:  # optim.name=adamw on fused_adam's keys
        chosen = f"the optimizer is chosen by its config group (optim={name}); optim.name follows the group"
        raise ConfigError("optim.name", name, chosen, shown=name)


def another_optimizers_line(key: str | None, schema: type | None) -> str | None:
    """``optim.exp_avg_dtype: not a key of optim=adamw; a key of optim=fused_adam`` when ``key`` is not a key of
    the optimizer schema ``schema`` but another optimizer's (None otherwise)."""
    names = {s: n for n, s in OPTIM_SCHEMAS.items()}
    others = [n for n, s in OPTIM_SCHEMAS.items() if s is not schema and key in schema_keys(s, "optim.")]
    if schema not in names or key in schema_keys(schema, "optim.") or not others:
        return None
    return f"{key}: not a key of optim={names[schema]}; a key of {' and '.join(f'optim={n}' for n in others)}"
