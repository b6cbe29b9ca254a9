"""What torchtitan 0.3's Trainer needs to run on CPU with gloo ranks (tests/integrations/test_torchtitan_trainer.py).

``install()`` runs in the test's ranks (never in the pytest process: its stubs of HF datasets and tensorboard would
reach other tests), before ``torchtitan.trainer`` is imported (the first entries); it patches module attributes that
torchtitan copied at import, so it also works where the forkserver preloaded torchtitan already.
"""

from __future__ import annotations

import sys
import types

import torch

_installed = False


def _cpu_device_module() -> types.SimpleNamespace:
    cpu = torch.cpu
    return types.SimpleNamespace(
        set_device=cpu.set_device,
        device_count=lambda: 1,
        current_device=lambda: 0,
        synchronize=cpu.synchronize,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 30),
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None,
    )


def _masked_sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """flex_attention(q, k, v, block_mask=...) as scaled_dot_product_attention with the mask made dense."""
    from torch.nn.attention.flex_attention import create_mask

    assert score_mod is None and not return_aux.lse, "llama3: a mask, no score_mod, no lse"
    mask = create_mask(block_mask.mask_mod, q.size(0), None, q.size(-2), k.size(-2), device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, types.SimpleNamespace(lse=None, max_scores=None)


def _absent_module(name: str, what: str) -> types.ModuleType:
    """A module whose every name is a callable that raises: importing succeeds, using it says what is missing."""
    module = types.ModuleType(name)

    def missing(attr: str):
        if attr.startswith("__"):  # module protocol (__file__, __path__ ...): absent, as for any module
            raise AttributeError(attr)

        def absent(*args, **kwargs):
            raise ImportError(f"{name}.{attr}: {what} is not installed (tests/integrations/titan_cpu.py)")

        return absent

    module.__getattr__ = missing  # type: ignore[attr-defined]
    return module


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    # metrics.py imports torch.utils.tensorboard (needs the tensorboard package) at import; unused with tensorboard off.
    if "torch.utils.tensorboard" not in sys.modules:
        sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(SummaryWriter=None)
    # hf_datasets/text_datasets.py (imported by the trainer and config_registry) imports HF datasets; our data is local.
    if "datasets" not in sys.modules:
        for name in ("datasets", "datasets.distributed"):
            sys.modules[name] = _absent_module(name, "HF datasets")
    # the MoE expert-parallel kernels import triton (CUDA only, not installed) at import; dense llama3 never calls them.
    if "torchtitan.distributed.minimal_async_ep.kernels" not in sys.modules:
        name = "torchtitan.distributed.minimal_async_ep.kernels"
        sys.modules[name] = _absent_module(name, "triton")

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tool_utils
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    # torchtitan picks "cuda" when no accelerator is present; its device module must answer set_device,
    # current_device (int: gloo's barrier(device_ids=)), and the memory monitor's queries on CPU.
    module = _cpu_device_module()
    for mod in (tool_utils, metrics, dist_utils):
        mod.device_type, mod.device_module = "cpu", module
    parallel_dims.device_type = "cpu"  # its meshes: a "cuda" DeviceMesh cannot be built without CUDA
    # the trainer lowers PG timeouts after step 1 with torch.distributed.set_timeout, which torch 2.13 lacks: keep ours.
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda timeout, group=None: None
    # flex_attention has no backward on CPU ("FlexAttention does not support backward on CPU"): SDPA, same mask.
    attention.FlexAttention._compiled_flex_attn = _masked_sdpa
    # the block mask is built by a torch.compile'd create_block_mask (an inductor C++ build per rank): eager.
    attention._compiled_create_block_mask = create_block_mask


def gloo_reductions(parallelize_fn):
    """A model's parallelize_fn whose FSDP modules reduce-scatter with SUM (then scale): gloo has no PREMUL_SUM."""
    from torch.distributed.fsdp import FSDPModule

    def parallelize(model, **kwargs):
        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            # torchtitan sets gradient_divide_factor=1.0 -> ReduceOp.PREMUL_SUM(1.0), which gloo refuses: SUM, *1.0
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize
