"""The chunked export's CUDA pipeline with the portable backend (CUDA, no Transformer Engine needed): bitwise
equal to the per-state export for every pinning of the pooled buffers, within two chunks of GPU memory, and
the background pinning (cudaHostRegister) of released buffers: used by the next export, undone on free."""

from __future__ import annotations

import gc

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.optimizers.export import Pinning, export_state
from optim_factory.optimizers.te_fused_adam import TE_AVAILABLE
from tests.gpu.pinning import host_registered
from tests.gpu.test_te_fused_adam import measure, te_cls
from tests.helpers import FP8, assert_state_dicts_bitwise, local, make_params, run_steps

pytestmark = pytest.mark.cuda_only
CHUNK = 256 << 10
SHAPES = [(1024, 1024), (1000,), (512, 300), (2048, 256)]
CONFIGS = {
    "fp32": (torch.float32, {}),
    "bf16-fp16": (torch.float32, dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16)),
    "fp8-master-remainders": (
        torch.bfloat16,
        dict(master_weights=True, store_param_remainders=True, exp_avg_dtype=FP8, exp_avg_sq_dtype=FP8),
    ),
}


def _build(cfg: str, reuse: bool, pinning: Pinning = Pinning.register):
    dtype, kw = CONFIGS[cfg]
    params = make_params(dtype, shapes=SHAPES, device="cuda")
    opt = PortableFusedAdam(
        params,
        lr=1e-2,
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes=CHUNK,
        state_dict_offload_reuse_buffers=reuse,
        state_dict_offload_pinning=pinning,
        **kw,
    )
    run_steps(opt, params, 0, 2)
    return params, opt


@pytest.mark.parametrize("pinning", [None, *Pinning], ids=["fresh", *(p.value for p in Pinning)])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_cuda_chunked_export_bitwise_and_bounded(cfg, pinning, record):
    params, opt = _build(cfg, reuse=pinning is not None, pinning=pinning or Pinning.register)
    pool = opt.state_exporter.pool
    for round_ in range(3):
        sd, peak, _ = measure(opt.state_dict)
        record(test="cuda_chunked", cfg=cfg, pinning=pinning, round=round_, peak_bytes=peak, chunk_bytes=CHUNK)
        assert peak <= 2 * CHUNK + (1 << 20), peak
        assert_state_dicts_bitwise(sd, export_state(opt, cpu_offload=True), f"{cfg} {pinning} round {round_}")
        opt.release_state_dict(sd)
        pool.prepare([]).result()  # after the pool's thread has pinned the released buffers
        run_steps(opt, params, 2 + round_, 1)
    if pinning in (Pinning.register, Pinning.alloc):
        sd = opt.state_dict()
        assert all(local(v).is_pinned() for st in sd["state"].values() for v in st.values())


def test_bench_pool_buffers_count_exactly_the_pinned_leased_buffers():
    from scripts.bench_export import PoolBuffers

    params, opt = _build("bf16-fp16", reuse=True)
    counted = PoolBuffers(opt)
    sd = opt.state_dict()
    leased = [local(v) for st in sd["state"].values() for v in st.values()]
    assert counted.pinned_bytes() == 0  # the first export's buffers: pageable until released
    opt.release_state_dict(sd)
    opt.state_exporter.pool.prepare([]).result()  # after the pool's thread has pinned the released buffers
    assert counted.pinned_bytes() == sum(t.numel() * t.element_size() for t in leased if host_registered(t.data_ptr()))
    assert counted.pinned_bytes() > 0


def test_released_buffers_get_pinned_in_place_and_unpinned_when_freed():
    params, opt = _build("bf16-fp16", reuse=True)
    pool = opt.state_exporter.pool
    sd = opt.state_dict()
    assert not any(local(v).is_pinned() for st in sd["state"].values() for v in st.values())  # first: pageable
    ptrs = {local(v).data_ptr() for st in sd["state"].values() for v in st.values()}
    opt.release_state_dict(sd)
    pool.prepare([]).result()  # after the pool's thread has pinned the released buffers
    assert all(host_registered(ptr) for ptr in ptrs)  # every released buffer
    again = opt.state_dict()
    assert {local(v).data_ptr() for st in again["state"].values() for v in st.values()} == ptrs
    assert all(local(v).is_pinned() for st in again["state"].values() for v in st.values())
    assert_state_dicts_bitwise(again, export_state(opt, cpu_offload=True), "after pinning")
    del sd, again  # leased and dropped: freed (and unpinned) with the dictionary
    gc.collect()
    assert not any(host_registered(ptr) for ptr in ptrs)


def test_prepared_buffers_are_pinned_before_the_first_export():
    params, opt = _build("bf16-fp16", reuse=True)
    opt.prepare_state_dict().result()
    sd = opt.state_dict()
    assert all(local(v).is_pinned() for st in sd["state"].values() for v in st.values())
    assert_state_dicts_bitwise(sd, export_state(opt, cpu_offload=True), "first export into prepared buffers")


NEEDS_TE = pytest.mark.skipif(not TE_AVAILABLE, reason="TE's FusedAdam: Transformer Engine not importable")


@pytest.mark.parametrize("backend", ["portable", pytest.param("te", marks=NEEDS_TE)])
def test_cuda_background_export_overlaps_kernels_and_step_waits(backend, record):
    """The background export converts on a side stream while the caller's stream runs other kernels; ``step()``
    (TE's, too) waits for it; the result equals the synchronous export, and the GPU holds at most two chunks more
    than the same kernels and step without an export."""
    cls = PortableFusedAdam if backend == "portable" else te_cls()
    params = make_params(torch.bfloat16, shapes=[(4096, 1024)] * 4, device="cuda")
    kw = dict(master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    background = dict(state_dict_offload_reuse_buffers=True, state_dict_offload_background=True)
    opt = cls(params, lr=1e-2, **kw, state_dict_cpu_offload=True, state_dict_offload_chunk_bytes=CHUNK, **background)
    x = torch.randn(4096, 4096, device="cuda")

    def forward_backward_step(step: int) -> None:  # kernels on the caller's stream, then step()
        y = x
        for _ in range(20):
            y = torch.tanh(y @ x) * 0.01
        run_steps(opt, params, step, 1)

    def peak_of(fn) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    run_steps(opt, params, 0, 2)
    without = peak_of(lambda: forward_backward_step(2))
    for round_ in range(2):
        reference = export_state(opt, cpu_offload=True)
        sd: dict = {}

        def export_then_step(sd=sd, r=round_) -> None:
            with opt.deferred_state_dict():  # returns unfilled: the kernels below overlap the export
                sd.update(opt.state_dict())
            assert opt.state_dict_pending
            forward_backward_step(3 + r)

        peak = peak_of(export_then_step)
        assert not opt.state_dict_pending  # step() waited for it
        record(test="cuda_background", backend=backend, round=round_, peak_bytes=peak - without, chunk_bytes=CHUNK)
        assert peak <= without + 2 * CHUNK + (1 << 20), (peak, without)
        assert_state_dicts_bitwise(sd, reference, f"{backend} background export round {round_}")
        opt.release_state_dict(sd)


@pytest.mark.parametrize(
    "n, slot_bytes",
    [(24 << 20, 1 << 20), (24 << 20, (1 << 20) + 64), (600_000, 1 << 17)],
    ids=["1MiB-slots", "slots-not-page-sized", "ring-under-a-huge-page"],
)
def test_stager_ring_on_cuda_copies_every_byte_and_leaves_nothing_behind(n, slot_bytes, monkeypatch):
    """The staging ring on a side stream, the pool's threads waiting for the events: every byte lands, wrapping
    small slots many times; no thread stays; every buffer is pinned (each on its own: buffers of whole pages, also
    for a slot size that is not, else two registrations would share a page and the second be refused with a
    warning), and unpinned by close."""
    import threading
    import warnings

    import optim_factory.optimizers.export.staging as staging
    from optim_factory.optimizers.export.host_memory import host_empty

    pinned: list[int] = []  # the staging buffers the stager pinned, by address

    def register_host(t):
        done = host_memory_register(t)
        if done:
            pinned.append(t.data_ptr())
        return done

    host_memory_register = staging.register_host
    monkeypatch.setattr(staging, "register_host", register_host)

    src = torch.arange(n // 4, dtype=torch.int32, device="cuda")
    dst = host_empty(src.shape, src.dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    before = threading.active_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "cudaHostRegister refused a staging buffer" fails the test
        workers = staging.UnstageWorkers(4, stream.device)
        with workers, staging.Stager(n, stream, workers, slot_bytes=slot_bytes) as stager:
            with torch.cuda.stream(stream):
                for c in range(0, src.numel(), 1 << 20):
                    stager.put(src[c : c + (1 << 20)], dst[c : c + (1 << 20)])
            stager.flush()
    assert torch.equal(dst, src.cpu())
    assert len(pinned) == min(4, -(-n // slot_bytes)), pinned  # every buffer of the ring was pinned
    assert not any(host_registered(ptr) for ptr in pinned)  # and unpinned by close
    assert threading.active_count() == before


_NO_GPU0_CONTEXT = r"""
import concurrent.futures, ctypes, sys
import torch
from optim_factory.optimizers.export.host_memory import HostBufferPool, Slot
from optim_factory.optimizers.export.options import Pinning
from optim_factory.optimizers.export.staging import Stager, UnstageWorkers

cuda = ctypes.CDLL("libcuda.so.1")
def gpu0_context_active():
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)

torch.cuda.set_device(1)  # a rank on GPU 1
src = torch.arange(1 << 22, dtype=torch.int32, device="cuda:1")
at_start = gpu0_context_active()
dst = torch.empty(1 << 22, dtype=torch.int32)  # the unstaging threads wait on CUDA events and pin
side = torch.cuda.Stream(1)
side.wait_stream(torch.cuda.current_stream(1))
with UnstageWorkers(4, side.device) as workers, torch.cuda.stream(side):
    with Stager(src.numel() * 4, side, workers, slot_bytes=1 << 20) as stager:
        stager.put(src, dst)
        stager.flush()
assert torch.equal(dst, src.cpu())
from optim_factory import PortableFusedAdam  # the background export's thread and its pool

param = torch.nn.Parameter(torch.randn(1 << 20, device="cuda:1"))
opt = PortableFusedAdam([param], lr=1e-3, exp_avg_dtype=torch.bfloat16, state_dict_cpu_offload=True,
                        state_dict_offload_chunk_bytes=1 << 20, state_dict_offload_reuse_buffers=True,
                        state_dict_offload_background=True)
for _ in range(2):
    param.grad = torch.randn_like(param)
    opt.step()
    exported = opt.state_dict()
    opt.wait_state_dict()
    assert torch.equal(exported["state"][0]["exp_avg"], opt.state[param]["exp_avg"].float().cpu())
    opt.release_state_dict(exported)
pool = HostBufferPool()  # its pinning thread registers released buffers
buf = pool.take(Slot("k", (1 << 20,), torch.float32, Pinning.register))
pool.release(buf)
pool.prepare([]).result()  # after the pool's thread has pinned the released buffer
assert pool.is_pinned(buf)
after_ours = gpu0_context_active()
# the control: a plain thread that uses device 0 (its default) makes the context the probe must see
concurrent.futures.ThreadPoolExecutor(1).submit(torch.zeros, 1, device="cuda:0").result()
print(at_start, after_ours, gpu0_context_active())
"""


@pytest.mark.cuda_only
def test_a_refused_registration_does_not_fail_the_next_kernel():
    """cudaHostRegister of memory already registered is refused; the thread's last CUDA error it leaves is cleared,
    so the next kernel launch's error check does not raise it (a failure vLLM and maru also report)."""
    from optim_factory.optimizers.export.host_memory import host_empty, register_host, unregister_host

    t = host_empty(torch.Size([4 << 20]), torch.uint8)
    assert register_host(t)
    try:
        assert not register_host(t)  # already registered
        x = torch.ones(1 << 10, device="cuda") * 2  # a kernel launch and its check
        torch.cuda.synchronize()
        assert float(x.sum()) == 2048.0
    finally:
        unregister_host(t.data_ptr())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_export_threads_of_a_rank_on_gpu1_create_no_context_on_gpu0():
    """The export's threads (unstaging pool, pool pinner) make the rank's GPU current: a new thread's is
    device 0, where a first CUDA call would create a context on another rank's GPU. The control (a plain thread
    allocating on GPU 0) shows that the probe sees such a context; a plain thread that only waits on an event
    creates none, so it cannot be the control. Measured on 2 H200s with a background export thread that does not
    set its device: 'False True True', the context after ours (in git history:
    ``git log -- benchmarks/results/2026-11-30-h200-third``)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _NO_GPU0_CONTEXT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == ["False", "False", "True"], proc.stdout  # at start, after ours, control
