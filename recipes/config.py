"""Schemas of the recipe's config groups (model, data, checkpoint, trainer), registered in Hydra's ConfigStore.

With them, an unknown key or a wrongly typed value fails when Hydra composes the config, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from optim_factory.config import register_configs as register_optim_configs


@dataclass
class ModelConfig:
    vocab_size: int = 16
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_seq_len: int = 64
    dtype: str = "fp32"  # fp32 | bf16 (parameter dtype; bf16 pairs with master weights)
    tie_embeddings: bool = False


@dataclass
class DataConfig:
    kind: str = "addition"  # addition | tokens
    seq_len: int = 12
    digits: int = 2  # addition: operands have this many digits
    path: str | None = None  # tokens: flat little-endian uint16 token file
    batch_size: int = 64  # per rank
    seed: int = 1234


@dataclass
class CheckpointConfig:
    dir: str = "${run_dir}/checkpoints"
    every_steps: int = 100
    keep_last: int = 3  # 0: keep all
    async_save: bool = False
    flatten_optimizer_state_dict: bool = True
    resume: str = "auto"  # auto | never | <path of a checkpoint directory>
    fallback: bool = False  # resume=auto: if the newest complete checkpoint fails to load, try older ones
    enabled: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    stop_at: int = 0  # >0: stop after this step (checkpointed) as an interrupted job would; schedule follows max_steps
    warmup_steps: int = 20
    grad_clip: float = 1.0  # 0: off
    log_every: int = 25
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    progress: bool = True
    threads: int = 0  # torch intra-op threads on CPU; 0: torch's default


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    optim: Any = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def register_configs() -> None:
    """Register the recipe's and the optimizer's schemas (call before Hydra composes ``conf/train.yaml``)."""
    register_optim_configs()
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="checkpoint", name="checkpoint_schema", node=CheckpointConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
