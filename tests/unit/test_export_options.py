"""The export options: one frozen, validated object owned by the optimizer; the optimizer owns its exporter;
nothing is patched onto tensors or optimizers."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.optimizers import te_fused_adam
from optim_factory.optimizers.export import ExportOptions, OffloadedStateDict, Pinning
from optim_factory.rules.export import parse_bytes, size_text
from tests.helpers import make_params, run_steps

CONSTRUCTOR_NAMES = {
    "state_dict_cpu_offload": "cpu_offload",
    "state_dict_offload_chunk_bytes": "chunk_bytes",
    "state_dict_offload_reuse_buffers": "reuse_buffers",
    "state_dict_offload_pinning": "pinning",
    "state_dict_keep_bf16": "keep_bf16",
    "state_dict_offload_background": "background",
    "state_dict_offload_host_budget": "host_budget",
}


@pytest.mark.parametrize("cls", [PortableFusedAdam, te_fused_adam.FusedAdam], ids=["portable", "te"])
def test_constructor_options_are_keyword_only_with_the_options_defaults(cls):
    sig = inspect.signature(cls.__init__)
    for kwarg, field in CONSTRUCTOR_NAMES.items():
        assert sig.parameters[kwarg].kind is inspect.Parameter.KEYWORD_ONLY
        assert sig.parameters[kwarg].default == next(
            f.default for f in dataclasses.fields(ExportOptions) if f.name == field
        ), kwarg
    assert set(CONSTRUCTOR_NAMES.values()) == {f.name for f in dataclasses.fields(ExportOptions)}


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(cpu_offload=1), "state_dict_cpu_offload=1: expected True or False"),
        (dict(cpu_offload=False, chunk_bytes=1 << 20), "needs state_dict_cpu_offload=True"),
        (dict(cpu_offload=True, chunk_bytes=8), "state_dict_offload_chunk_bytes=8: expected None"),
        (dict(cpu_offload=True, chunk_bytes=-1), "state_dict_offload_chunk_bytes=-1: expected None"),
        (dict(chunk_bytes=0), "state_dict_offload_chunk_bytes=0: needs state_dict_cpu_offload=True"),
        (dict(reuse_buffers=True), "reuse_buffers=True: needs state_dict_cpu_offload"),
        (dict(cpu_offload=True, chunk_bytes=0, reuse_buffers=True), "needs state_dict_offload_chunk_bytes != 0"),
        (dict(cpu_offload=True, chunk_bytes=64, reuse_buffers=True, pinning="pinned"), "expected one of register"),
        (dict(cpu_offload=True, chunk_bytes=64, pinning="alloc"), "needs state_dict_offload_reuse_buffers=True"),
        (dict(cpu_offload=True, chunk_bytes=64, background=1), "state_dict_offload_background=1: expected True"),
        (dict(cpu_offload=True, chunk_bytes=0, background=True), "background=True: needs state_dict_offload_chunk"),
        (dict(background=True), "background=True: needs state_dict_cpu_offload=True"),
    ],
)
def test_impossible_options_are_one_line(kwargs, needle):
    with pytest.raises(ValueError) as info:
        ExportOptions(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)


FLAGS = [k for k, f in CONSTRUCTOR_NAMES.items() if isinstance(ExportOptions.__dataclass_fields__[f].default, bool)]


@pytest.mark.parametrize("kwarg", FLAGS)
def test_every_flag_is_refused_unless_a_bool(kwarg):
    on = dict(cpu_offload=True, chunk_bytes=64)  # a chunked export: only the flag under test is wrong
    with pytest.raises(ValueError, match=rf"^{kwarg}='yes': expected True or False$"):
        ExportOptions(**{**on, CONSTRUCTOR_NAMES[kwarg]: "yes"})


def test_options_are_frozen_and_read_only_on_the_optimizer():
    params = make_params(torch.float32)
    opt = PortableFusedAdam(
        params,
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes=64,
        state_dict_offload_reuse_buffers=True,
        state_dict_offload_pinning="none",
    )
    assert opt.export_options == ExportOptions(True, 64, True, Pinning.none)
    assert opt.state_dict_offload_pinning is Pinning.none
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.export_options.cpu_offload = False
    with pytest.raises(AttributeError):  # no silent instance attribute that the export would ignore
        opt.state_dict_cpu_offload = False


def test_the_optimizer_owns_its_exporter_and_nothing_is_patched_onto_tensors_or_optimizers():
    params = make_params(torch.float32, shapes=[(8, 5), (33,)])
    kw = dict(state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=64, state_dict_offload_reuse_buffers=True)
    opt = PortableFusedAdam(params, exp_avg_dtype=torch.bfloat16, **kw)
    exporter = opt.state_exporter  # created in __init__, before any export
    attributes = set(vars(opt))
    run_steps(opt, params, 0, 1)
    opt.prepare_state_dict().result()
    for _ in range(2):
        sd = opt.state_dict()
        for st in sd["state"].values():
            for v in st.values():
                assert not any(k.startswith("_optim_factory") for k in dir(v)), "attribute patched onto a tensor"
                assert opt.is_leased_export_buffer(v)
        opt.release_state_dict(sd)
    assert opt.state_exporter is exporter
    assert set(vars(opt)) - attributes <= {"_scales"}  # only the optimizer's own state grew
    assert isinstance(opt, OffloadedStateDict)


def test_the_constructor_warns_that_offload_saves_nothing_without_a_gpu(monkeypatch):
    """As ``build_optimizer`` does (it builds through the constructor): on a machine with a GPU, one warning for
    CPU parameters, none without the offload; on a machine without one (the README's CPU examples), none (this
    machine's ``torch.cuda.is_available`` made to say each)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        PortableFusedAdam(make_params(torch.float32), state_dict_cpu_offload=True)  # no GPU: nothing to say
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        PortableFusedAdam(make_params(torch.float32))
    with pytest.warns(UserWarning, match="state_dict_cpu_offload=True has no memory effect here") as record:
        PortableFusedAdam(make_params(torch.float32), state_dict_cpu_offload=True)
    assert len(record) == 1


@pytest.mark.parametrize("nbytes", [1, 1000, 1024, 1025, 5056, 4 << 20, 123456789, 1 << 30, (1 << 30) + 1, 3 << 40])
def test_a_size_text_reads_back_as_at_least_its_bytes_and_at_most_one_percent_more(nbytes):
    """The refusals' least budgets (``a budget of at least 118MiB (123456789 bytes)``): a size the option's parser
    reads, rounded up (a least budget pasted back is enough), in the largest unit within 1 %."""
    text = size_text(nbytes)
    assert nbytes <= parse_bytes(text, "optim.state_dict_offload_host_budget") <= nbytes * 1.01, text
    assert size_text(123456789) == "118MiB" and size_text(4 << 20) == "4MiB" and size_text(1000) == "1000B"
