"""torchtitan 0.3's train entry point (its ConfigManager parses a command line naming this module's config_registry
function, the llama3 debug model shrunk; the config builds its Trainer) on 2 gloo ranks (CPU) with FSDP2, our
optimizer selected by the docs' override (``--override.imports ...use_fused_adam=...``) and our
``CheckpointManager``: a run saved at step 2 (``async_mode="async_with_pinned_mem"``: the Trainer waits for the
staging before step 3's optimizer step, so the background export is deferred) and stopped after step 3, resumed
(saved at step 4 with ``async_mode="async"``, stopped after step 5) and resumed to step 6 ends bitwise where the
run that never stopped (saved synchronously) does (parameters, optimizer state, LR schedule). The data and
tokenizer are made here (no download)."""

from __future__ import annotations

import shlex
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp as fsdp

from tests.integrations import INSTALL

pytest.importorskip("torchtitan", reason=f"torchtitan is not installed: {INSTALL}")
pytest.importorskip("torchdata", reason="torchtitan's Trainer imports torchdata: pip install --no-deps torchdata")
if not hasattr(fsdp, "DataParallelMeshDims"):  # imported by torchtitan 0.3's Trainer (2.13 has it)
    pytest.skip(
        f"torchtitan 0.3's Trainer needs torch.distributed.fsdp.DataParallelMeshDims, which torch {torch.__version__} "
        "lacks (our integration itself is tested on this torch by test_torchtitan.py)",
        allow_module_level=True,
    )

from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402

import optim_factory  # noqa: E402
from optim_factory.integrations import torchtitan as integration  # noqa: E402
from tests.distributed.launch import spawn  # noqa: E402
from tests.helpers import assert_flat_bitwise, drop_in_block  # noqa: E402
from tests.integrations import titan_cpu  # noqa: E402

STEPS, LAYERS, SEQ_LEN, BATCH = 6, 2, 32, 2
OPTIONS = (  # FP32 params: an FP32 master of its own; a background export into pooled buffers, for the async saves
    '{"name": "PortableFusedAdam", "master_weights": true, "state_dict_cpu_offload": true, '
    '"state_dict_offload_background": true, "state_dict_offload_reuse_buffers": true}'
)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class ByteTokenizer(BaseTokenizer):
    """A token per byte (ids 0..255, 0 doubles as EOS): no tokenizer files."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str = ""):
        super().__init__()
        self.eos_id = 0

    def encode(self, text: str, **kwargs) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **kwargs) -> str:
        return bytes(ids).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return 256


class Windows(Dataset):
    """This rank's windows of a tokenized text, one document each: ({"input", "positions"}, labels)."""

    def __init__(self, tokens: list[int], seq_len: int, dp_rank: int, dp_world_size: int):
        self.tokens, self.seq_len, self.rank, self.world = torch.tensor(tokens), seq_len, dp_rank, dp_world_size

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int):
        start = ((i * self.world + self.rank) * 7 * self.seq_len) % (len(self.tokens) - self.seq_len - 1)
        w = self.tokens[start : start + self.seq_len + 1]
        return {"input": w[:-1], "positions": torch.arange(self.seq_len)}, w[1:]


class TinyDataLoader(ParallelAwareDataloader):
    """torchtitan's stateful data-parallel loader (its state is checkpointed) over ``Windows`` of a made-up text."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        pass

    def __init__(self, config: Config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size,
                 snapshot_every_n_steps=1, **kwargs):  # fmt: skip
        text = " ".join(f"word{(i * 7919) % 1009}" for i in range(3000))
        super().__init__(
            Windows(tokenizer.encode(text), seq_len, dp_rank, dp_world_size),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )


def override_token() -> str:
    """The docs' ``--override.imports`` argument, with the portable class and FP32-parameter options."""
    flag, token = shlex.split(drop_in_block("torchtitan-override"))
    assert flag == "--override.imports"
    target, _, _ = token.partition("=")
    return f"{target}={OPTIONS}"


def tiny_debugmodel():
    """A config_registry function (``--module <this module> --config tiny_debugmodel``): torchtitan's
    llama3_debugmodel, shrunk, with our data and our CheckpointManager; the optimizer is the command line's."""
    from torchtitan.components.validate import Validator
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:LAYERS]
    config.model_spec.parallelize_fn = titan_cpu.gloo_reductions(config.model_spec.parallelize_fn)
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = TinyDataLoader.Config()
    config.training.local_batch_size, config.training.seq_len, config.training.steps = BATCH, SEQ_LEN, STEPS
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "float32"  # FSDP2 compute in FP32: bf16 matmuls are slow on CPU
    config.activation_checkpoint = None  # no recompute in backward (parallelize_llama skips AC for None)
    config.validator = Validator.Config(enable=False)
    config.debug.seed = 0
    # FSDP2 over the dp mesh: the default backend, spmd_types, refuses the plain tensors of this CPU setup
    config.parallelism.spmd_backend = "partial_dtensor"
    config.checkpoint = integration.CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=2, last_save_model_only=False, keep_latest_k=0
    )
    return config


def run(folder: str, stop: int, async_mode: str = "disabled") -> tuple[dict, int]:
    """torchtitan's train entry point (``torchtitan.train.main``: its ConfigManager parses the command line, the
    config builds the Trainer, which trains) for a job of STEPS steps, stopped after step ``stop`` (a preemption:
    the LR schedule stays the job's); it loads the latest checkpoint first. Its state, and the steps it ran."""
    from torchtitan.config import ConfigManager

    argv = ["--module", __name__, "--config", "tiny_debugmodel", "--override.imports", override_token()]
    argv += ["--dump_folder", folder, "--hf_assets_path", folder, "--checkpoint.async_mode", async_mode]
    trainer = ConfigManager().parse_args(argv).build()
    try:
        optimizer = trainer.optimizers.optimizers[0]
        assert type(optimizer) is optim_factory.PortableFusedAdam, type(optimizer)  # the override took effect
        assert optimizer.adam_options.master_weights
        assert type(trainer.checkpointer) is integration.CheckpointManager
        assert optimizer.export_options.background and optimizer.export_options.reuse_buffers
        trainer.should_continue_training = lambda: trainer.step < stop
        ran = []
        train_step = trainer.train_step
        trainer.train_step = lambda it: (ran.append(trainer.step), train_step(it))[1]
        trainer.train()
        assert trainer.step == stop
        state = snapshot(trainer)
        trainer.checkpointer.maybe_wait_for_saving()  # the async save of the last step: close() does not wait for it
    finally:
        trainer.close()
    return state, len(ran)


def snapshot(trainer) -> dict:
    def local(v):
        v = v.to_local() if isinstance(v, DTensor) else v
        return v.detach().clone() if isinstance(v, torch.Tensor) else v

    model = trainer.model_parts[0]
    assert isinstance(next(model.parameters()), DTensor)  # FSDP2: sharded parameters
    out = {f"param.{k}": local(v) for k, v in model.named_parameters()}
    out.update({f"optim.{k}": local(v) for k, v in trainer.optimizers.state_dict().items()})
    out.update({f"lr.{k}": v for k, v in trainer.lr_schedulers.state_dict().items()})
    return out


def uninterrupted_vs_resumed(rank: int, world: int, root: str) -> None:
    # in the ranks only: the shim stubs modules (HF datasets, tensorboard) that other tests' processes must not see
    titan_cpu.install()
    import torchtitan.trainer

    # rank 0 sleeps 2 s at the end of Trainer.train() (for the other ranks' logs): 8 s of 4 runs, not needed here
    torchtitan.trainer.time = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=lambda seconds: None)
    expected, ran = run(str(Path(root, "straight")), STEPS)
    assert ran == STEPS
    folder = str(Path(root, "resumed"))
    # each run trains a step past its last save: the save staged beside the next step's forward and backward
    assert run(folder, 3, async_mode="async_with_pinned_mem")[1] == 3  # saves step 2, stopped after step 3
    assert run(folder, 5, async_mode="async")[1] == 3  # loads step 2, saves step 4, stopped after step 5
    actual, ran = run(folder, STEPS)  # loads step 4
    assert ran == 2
    assert all(Path(folder, "checkpoint", f"step-{s}", ".metadata").is_file() for s in (2, 4))
    assert any(k.startswith("optim.") and "master_param" in k for k in expected), sorted(expected)[:8]
    assert_flat_bitwise(actual, expected)


@pytest.mark.slow  # forked ranks
def test_trainer_resumed_twice_is_bitwise_the_uninterrupted_run(tmp_path):
    spawn(uninterrupted_vs_resumed, 2, str(tmp_path))
