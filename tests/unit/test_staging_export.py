"""The no-pool export's host side on CPU: the staging ring and its threads copy every byte exactly once
(bitwise equal to the per-state export for pieces cut across chunks, staging buffers and threads), the
thread rule, the unstaging threads (started with the optimizer, kept between exports), and host memory (RSS)
back to its baseline once the export is freed."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from optim_factory import PortableFusedAdam
from optim_factory.optimizers.export import export_state
from optim_factory.optimizers.export.host_memory import fault_in, host_empty
from optim_factory.optimizers.export.staging import (
    MIN_SLICE_BYTES,
    SLOT_BYTES,
    STAGING_SLOTS,
    Stager,
    UnstageWorkers,
    fault_pieces,
    split_bytes,
    unstage_threads,
)
from tests.helpers import assert_state_dicts_bitwise

M = 1 << 20
# BF16 parameters with BF16 moments and an FP32 master: converted (moments) and copied (master) states. The
# sizes are not multiples of the staging buffer, so pieces are cut across chunks, staging buffers and threads,
# and 72 MiB of FP32 output wraps the 4 x 8 MiB staging ring twice.
SHAPES = [(3 * M + 5,), (2 * M,), (M + 17,), (4096,), (0,)]
KW = dict(master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)


def _rss() -> int:
    """Anonymous resident bytes, counted by walking the page tables (``Anonymous`` of /proc/self/smaps_rollup).
    Not ``VmRSS``: it also counts file-backed pages (the mapped libraries), which the kernel may reclaim at any
    moment (measured on a shared machine: VmRSS fell 35 MiB during an export). Not ``RssAnon`` either: its per-CPU
    counters lag behind pages faulted in by other threads (measured in a clean-clone CI run: +2.1 of 72 MiB
    exported while the export was alive)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Anonymous in /proc/self/smaps_rollup")


def _mappings() -> dict[tuple[int, int], int]:
    """This process's mappings: (start, end) -> resident bytes (``Rss`` of /proc/self/smaps)."""
    out, current = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                current = (start, end)
            elif head == "Rss:" and current is not None:
                out[current] = int(line.split()[1]) * 1024
    return out


def _own_mappings(tensors: list[torch.Tensor]) -> dict[tuple[int, int], int]:
    """The mappings (with their resident bytes) that hold ``tensors``: ``host_empty`` gives every tensor of at
    least 2 MiB a mapping of its own (the kernel may merge adjacent ones into one)."""
    maps = _mappings()
    return {
        (start, end): rss for (start, end), rss in maps.items() if any(start <= t.data_ptr() < end for t in tensors)
    }


def _optimizer(chunk: int, reuse: bool, background: bool = False) -> PortableFusedAdam:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16)) for s in SHAPES]
    opt = PortableFusedAdam(
        params,
        lr=1e-2,
        state_dict_cpu_offload=True,
        state_dict_offload_chunk_bytes=chunk,
        state_dict_offload_reuse_buffers=reuse,
        state_dict_offload_background=background,
        **KW,
    )
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()
    return opt


def test_split_bytes_covers_every_byte_once_in_bounded_parts():
    jobs = [(1000, 50, 3 * M + 7), (10**9, 7, 5), (2 * 10**9, 9, M // 2)]
    total = sum(n for _, _, n in jobs)
    for parts in (1, 2, 3, 8, 100):
        out = split_bytes(jobs, parts)
        assert 1 <= len(out) <= min(parts, total // MIN_SLICE_BYTES)
        assert all(sum(n for _, _, n in part) >= MIN_SLICE_BYTES for part in out)
        # glued back in order, the parts are exactly the jobs: same addresses, every byte once
        flat = [piece for part in out for piece in part]
        rebuilt: list[tuple[int, int, int]] = []
        for dst, src, n in flat:
            last = rebuilt[-1] if rebuilt else None
            if last and last[0] + last[2] == dst and last[1] + last[2] == src:
                rebuilt[-1] = (last[0], last[1], last[2] + n)
            else:
                rebuilt.append((dst, src, n))
        assert rebuilt == jobs, parts
    assert split_bytes([(0, 0, 100)], 8) == [[(0, 0, 100)]]  # less than a slice: one part


def test_fault_pieces_cover_a_buffer_in_whole_huge_pages_one_per_thread_at_most():
    huge = 2 * M
    for nbytes, parts in [(32 * M, 12), (32 * M, 1), (32 * M, 16), (2 * M, 4), (100, 3), (5 * M + 7, 2), (64 * M, 12)]:
        pieces = fault_pieces(nbytes, parts)
        assert pieces[0][0] == 0 and pieces[-1][1] == nbytes, (nbytes, parts, pieces)
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), pieces  # contiguous, in order
        assert len(pieces) <= parts and all((b - a) % huge == 0 for a, b in pieces[:-1]), (nbytes, parts, pieces)
    assert fault_pieces(32 * M, 12) == [(a, a + 4 * M) for a in range(0, 32 * M, 4 * M)]  # 16 pages over 12: 2 each
    assert fault_pieces(0, 4) == []


def test_stager_faults_its_whole_ring_in_ahead_of_use():
    """The pool faults every staging buffer in from the start (in pieces, fault_in), so later buffers are resident
    (and, on CUDA, quick to pin) by the time the device needs them: with one buffer of the four used, the staging
    memory's own mapping becomes wholly resident. Broken on purpose (no fault-in pieces): 32 of 128 MiB."""
    ring = STAGING_SLOTS * SLOT_BYTES
    src, dst = torch.ones(SLOT_BYTES // 4), torch.zeros(SLOT_BYTES // 4)
    before = set(_mappings())
    with UnstageWorkers(4) as workers, Stager(ring, None, workers) as stager:
        stager.put(src, dst)  # one buffer's worth: only the first buffer is used
        stager.flush()
        deadline, staging = time.monotonic() + 10, 0
        while staging < ring and time.monotonic() < deadline:
            new = {k: rss for k, rss in _mappings().items() if k not in before and k[1] - k[0] >= ring}
            staging = max(new.values(), default=0)
            time.sleep(0.01)
    assert torch.equal(dst, src)
    assert staging >= ring, f"{staging >> 20} of {ring >> 20} MiB of staging resident"


def test_a_failed_copy_neither_hangs_close_nor_goes_unreported(monkeypatch):
    """A slot's copy fails on a pool thread while the caller fails for its own reason: close() still returns
    (it once spun on the failed future forever) and the threads are gone; a flush reports the copy's failure."""
    import optim_factory.optimizers.export.staging as staging

    def failing_copy(event, part):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(staging, "_copy", failing_copy)
    before = set(threading.enumerate())

    def fail_after_sealing(flush: bool) -> None:
        dst = torch.zeros(SLOT_BYTES // 4 + M)
        with UnstageWorkers(2) as workers, Stager(4 * SLOT_BYTES, None, workers) as stager:
            stager.put(torch.ones(dst.numel()), dst)  # seals the first buffer: its copy fails on a thread
            if flush:
                stager.flush()
            stager.put(torch.ones(4), torch.empty(3))  # the caller's own error

    for flush, error in ((False, ValueError), (True, RuntimeError)):
        raised: list[BaseException] = []

        def run(flush=flush, raised=raised) -> None:
            try:
                fail_after_sealing(flush)
            except BaseException as e:  # noqa: BLE001 - checked below
                raised.append(e)

        runner = threading.Thread(target=run, daemon=True)  # a daemon: a hang fails the test, not the suite
        runner.start()
        runner.join(timeout=60)
        assert not runner.is_alive(), "Stager.close() did not return after a failed copy"
        assert len(raised) == 1 and isinstance(raised[0], error), raised
    assert not set(threading.enumerate()) - before


def test_unstage_threads_rule(monkeypatch):
    assert unstage_threads(cpus=16, local_ranks=1) == 12  # MAX_UNSTAGE_THREADS
    assert unstage_threads(cpus=32, local_ranks=2) == 12
    assert unstage_threads(cpus=20, local_ranks=2) == 10
    assert unstage_threads(cpus=16, local_ranks=4) == 4
    assert unstage_threads(cpus=2, local_ranks=8) == 1
    assert unstage_threads(cpus=5, local_ranks=2) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert unstage_threads(cpus=16) == 4
    for bad in ("0", "two", ""):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE='{bad}': expected a positive integer"):
            unstage_threads(cpus=16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # srun's step, in each of Slurm's forms; one that is not is 1, not an error
    for tasks, node, threads in (("4", "0", 4), ("2(x3),1", "1", 8), ("2(x3),1", "3", 12), ("lots", "0", 12)):
        monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", tasks)
        monkeypatch.setenv("SLURM_NODEID", node)
        assert unstage_threads(cpus=16) == threads, (tasks, node)


@pytest.mark.parametrize(
    "threads, slot_bytes",
    [(1, SLOT_BYTES), (3, SLOT_BYTES), (3, M + 64)],
    ids=["1-thread", "3-threads", "3-threads-small-slots"],
)
def test_stager_copies_every_byte_through_the_ring(threads, slot_bytes):
    gen = torch.Generator().manual_seed(1)
    sizes = [5, SLOT_BYTES // 4 + 3, 2 * SLOT_BYTES + 1, 0, 7 * M + 1, 3, (STAGING_SLOTS + 1) * SLOT_BYTES // 8]
    dtypes = [torch.float32, torch.int16, torch.uint8, torch.float32, torch.bfloat16, torch.float64, torch.float32]
    sources = [torch.randint(-100, 100, (n,), generator=gen).to(d) for n, d in zip(sizes, dtypes)]
    dsts = [host_empty(torch.Size([n]), d) for n, d in zip(sizes, dtypes)]
    before = set(threading.enumerate())  # (other tests' threads may end meanwhile: a count would differ)
    total = sum(s.numel() * s.element_size() for s in sources)
    with UnstageWorkers(threads) as workers, Stager(total, None, workers, slot_bytes=slot_bytes) as stager:
        for s, d in zip(sources, dsts):
            stager.put(s, d)
        stager.flush()
    for i, (s, d) in enumerate(zip(sources, dsts)):
        assert torch.equal(s.view(torch.uint8) if s.numel() else s, d.view(torch.uint8) if d.numel() else d), i
    assert not set(threading.enumerate()) - before, "the stager's threads outlived it"


def test_stager_empties_a_slot_before_it_is_filled_again():
    """Refilling a slot must wait for all of its slices, or the next put overwrites staging bytes not yet copied
    out. Many small slots wrapping the ring many times, with slices slowed down (many threads on few CPUs),
    expose that."""
    n = 48 * M
    src = torch.arange(n // 8, dtype=torch.int64)
    for _ in range(3):
        dst = host_empty(src.shape, src.dtype)
        with UnstageWorkers(8) as workers, Stager(n, None, workers, slot_bytes=2 * M) as stager:
            for c in range(0, src.numel(), 64 * 1024):
                stager.put(src[c : c + 64 * 1024], dst[c : c + 64 * 1024])
            stager.flush()
        assert torch.equal(dst, src)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(threads=0), "threads=0: expected an int >= 1"),
        (dict(slot_bytes=100), "slot_bytes=100: expected a positive multiple of 64"),
        (dict(slot_bytes=0), "slot_bytes=0: expected a positive multiple of 64"),
        (dict(total_bytes=0), "total_bytes=0: expected an int >= 1"),
    ],
)
def test_stager_refuses_bad_options_in_one_line(kwargs, match):
    before = set(threading.enumerate())
    args = dict(threads=2, total_bytes=M) | kwargs
    with pytest.raises(ValueError, match=match):
        with UnstageWorkers(args.pop("threads")) as workers:
            Stager(args.pop("total_bytes"), None, workers, **args)
    assert not set(threading.enumerate()) - before


def test_stager_refuses_mismatched_tensors_and_frees_its_threads_after_an_error():
    before = set(threading.enumerate())
    dst = torch.zeros(SLOT_BYTES // 4 + M)
    with pytest.raises(ValueError, match="3 destination elements"):
        with UnstageWorkers(2) as workers, Stager(4 * SLOT_BYTES, None, workers) as stager:
            stager.put(torch.ones(dst.numel()), dst)  # fills and seals a slot: its copy runs on a thread
            stager.put(torch.ones(4), torch.empty(3))
    assert not set(threading.enumerate()) - before
    assert torch.equal(dst[: SLOT_BYTES // 4], torch.ones(SLOT_BYTES // 4))  # the sealed slot was copied
    with pytest.raises(ValueError, match="of its dtype"):
        with UnstageWorkers(1) as workers, Stager(64, None, workers) as stager:
            stager.put(torch.ones(4), torch.empty(4, dtype=torch.float64))


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reuse"])
@pytest.mark.parametrize("chunk", [64 * 1024, 5 * M + 3, 64 * M])
def test_large_chunked_export_is_bitwise_the_per_state_export(chunk, reuse):
    opt = _optimizer(chunk, reuse)
    reference = export_state(opt, cpu_offload=True)
    for round_ in range(2):
        sd = opt.state_dict()
        assert_state_dicts_bitwise(sd, reference, f"chunk={chunk} round {round_}")
        opt.release_state_dict(sd)
        del sd


@pytest.mark.parametrize("chunk", [4 * M, 64 * M])
def test_fresh_export_gives_host_memory_back_when_freed(chunk):
    """The no-pool export leaves nothing allocated: after ``del sd`` anonymous RSS is back at its value before
    the first export (destinations, staging buffers and device buffers freed; the unstaging threads, started
    with the optimizer before the baseline, are the same ones throughout). Measured here
    (72 MiB exported, 2 CPUs, RssAnon): +0.06 to +0.07 MiB after freeing (VmRSS: +0.56 to +0.90 MiB), +74.1
    to +76.1 MiB while the export is alive. With glibc-allocated destinations and kept staging buffers, 64 MiB
    chunks leave +72.6 MiB (VmRSS) after freeing. The 4 MiB tolerance leaves room for the
    pytest process's own allocations and is below anything the export could keep: the 32 MiB staging ring, or
    one of its destinations (the smallest of at least 2 MiB is 8 MiB)."""
    opt = _optimizer(chunk, reuse=False)
    gc.collect()
    baseline, threads = _rss(), set(threading.enumerate())
    for round_ in range(2):
        sd = opt.state_dict()
        large = [v for st in sd["state"].values() for v in st.values() if v.numel() * v.element_size() >= 2 * M]
        own = _own_mappings(large)
        large_bytes = sum(v.numel() * v.element_size() for v in large)
        # the export's own mappings, resident while it is alive (the process-wide count is no measure of that
        # here: the kernel reclaims other cold pages of the process meanwhile, measured: +27 of 72 MiB)
        assert large and sum(own.values()) >= large_bytes, (sum(own.values()), large_bytes)
        del sd, large
        gc.collect()
        assert not set(own) & set(_mappings()), f"round {round_}: an export mapping is still mapped after freeing"
        grown = _rss() - baseline
        assert grown <= 4 * M, f"round {round_}: RSS {grown / M:.1f} MiB above its baseline after freeing"
        assert not set(threading.enumerate()) - threads


@pytest.mark.parametrize("populate", [True, False], ids=["madvise", "touch"])
def test_fault_in_makes_every_page_resident(populate):
    """``fault_in`` faults a fresh destination in on the calling thread: its mapping becomes resident (0 before,
    all 32 MiB after, both ways); the madvise way keeps
    the bytes, also of the first partial page before an unaligned slice, and refuses non-contiguous tensors."""
    t = host_empty(torch.Size([32 * M]), torch.uint8)
    assert sum(_own_mappings([t]).values()) == 0  # fresh: nothing resident yet
    how = fault_in(t, populate=populate)
    resident = sum(_own_mappings([t]).values())  # the tensor's own mapping (other pages may be reclaimed meanwhile)
    assert how in (("madvise", "touch") if populate else ("touch",))  # madvise falls back to touch before 5.14
    assert resident >= 32 * M, resident / M
    if how == "madvise":
        t[:100].copy_(torch.arange(100, dtype=torch.uint8))
        assert fault_in(t[7:5000]) == "madvise"
        assert torch.equal(t[:100], torch.arange(100, dtype=torch.uint8))
    assert fault_in(t[:0]) == "empty"
    with pytest.raises(ValueError, match="contiguous host tensor"):
        fault_in(torch.zeros(8, 8).t())


def test_worker_threads_make_the_given_cuda_device_current(monkeypatch):
    """Every thread of a pool for a CUDA device calls torch.cuda.set_device(device) before its first task (a new
    thread's device is 0); for no device or a CPU device, nothing is set. Recorded on CPU: set_device replaced."""
    import threading

    from optim_factory.optimizers.export.threads import worker_threads

    seen: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append((threading.current_thread().name, d)))
    device = torch.device("cuda", 1)
    pool = worker_threads(2, "probe", device)
    names = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(8)}
    pool.shutdown(wait=True)
    assert seen and all(d == device for _, d in seen) and names <= {n for n, _ in seen}
    seen.clear()
    for plain in (None, torch.device("cpu")):
        pool = worker_threads(1, "plain", plain)
        pool.submit(lambda: None).result()
        pool.shutdown(wait=True)
    assert seen == []


def _unstage_threads_alive() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.name.startswith("export-unstage")}


def test_unstaging_threads_start_with_the_optimizer_and_serve_every_export():
    """A chunked export's unstaging threads are running when the optimizer is built (so that no export waits for
    them: 15 of 125 ms of an H200's first export), and every export uses the same ones: none starts, none ends.
    Broken on purpose: without ``_start_export_threads`` none runs before the first export; with a stager that
    ends the threads it was given, the second export's are new ones."""
    before = _unstage_threads_alive()
    opt = _optimizer(4 * M, reuse=False)
    started = _unstage_threads_alive() - before
    assert len(started) == unstage_threads(), (len(started), unstage_threads())
    reference = export_state(opt, cpu_offload=True)
    for round_ in range(2):
        sd = opt.state_dict()
        assert_state_dicts_bitwise(sd, reference, f"round {round_}")
        del sd
        assert _unstage_threads_alive() - before == started, f"round {round_}: the unstaging threads changed"
    opt.state_exporter.close()
    assert not _unstage_threads_alive() - before, "close() left unstaging threads running"
    assert_state_dicts_bitwise(opt.state_dict(), reference, "after close")  # started again when needed
    opt.state_exporter.close()


def test_only_an_optimizer_for_a_staged_chunked_export_starts_the_unstaging_threads():
    """An optimizer built for a chunked export starts the threads, one built for any other export starts none: a
    per-state export streams nothing, and CPU buffers that are reused are copied into directly. Broken on
    purpose (threads for every offloaded export): the other two optimizers start them too."""
    before = _unstage_threads_alive()
    opt = _optimizer(4 * M, reuse=False)
    assert len(_unstage_threads_alive() - before) == unstage_threads()
    opt.state_exporter.close()
    assert _unstage_threads_alive() == before
    for chunk, reuse in ((0, False), (4 * M, True)):  # per state; reused CPU buffers
        other = _optimizer(chunk, reuse)
        assert _unstage_threads_alive() == before, (chunk, reuse)
        other.state_exporter.close()


def test_a_temporary_exporter_ends_its_threads_with_its_export(monkeypatch):
    """export_state without the optimizer's exporter (TE's own class) uses a temporary one, whose threads end
    with the export, not whenever it is collected. Broken on purpose (no close): its workers are still alive."""
    import optim_factory.optimizers.export.plan as plan

    workers: list[UnstageWorkers] = []

    class Recording(plan.StateExporter):
        def unstage_workers(self, device):
            workers.append(super().unstage_workers(device))
            return workers[-1]

    monkeypatch.setattr(plan, "StateExporter", Recording)
    opt = _optimizer(4 * M, reuse=False)
    reference = export_state(opt, cpu_offload=True)
    assert_state_dicts_bitwise(export_state(opt, cpu_offload=True, chunk_bytes=4 * M), reference, "temporary")
    assert workers and not any(w.alive for w in workers)
    opt.state_exporter.close()


def _export_in_child(opt, reference, mode, queue) -> None:
    torch.set_num_threads(1)  # torch's OpenMP pool does not survive a fork (its next parallel copy hangs)
    if mode == "prepared":
        opt.prepare_state_dict()  # the pool's background thread allocates the buffers
    sd = opt.state_dict()
    opt.wait_state_dict()  # "background": the exporter's background thread fills the dictionary
    states = reference["state"]
    queue.put(all(torch.equal(sd["state"][k][n], states[k][n]) for k in states for n in states[k]))


@pytest.mark.parametrize("mode", ["fresh", "background", "prepared"])
def test_a_forked_child_exports_with_threads_of_its_own(mode):
    """A fork copies the exporter but not its threads: the child's export starts threads of its own instead of
    queueing work that no thread runs. Each mode needs other threads: "fresh" the unstaging workers,
    "background" the exporter's background thread, "prepared" the buffer pool's thread. Broken on purpose
    (the threads kept whatever the process), each mode's child hangs."""
    import multiprocessing as mp

    opt = _optimizer(4 * M, reuse=mode == "prepared", background=mode == "background")
    reference = export_state(opt, cpu_offload=True)
    # the parent's threads exist before the fork: an export (and a preparation) ran here first
    opt.prepare_state_dict()
    opt.release_state_dict(opt.state_dict())
    opt.wait_state_dict()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_export_in_child, args=(opt, reference, mode, queue), daemon=True)
    child.start()
    child.join(timeout=60)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung, f"the forked child's {mode} export did not finish"
    assert child.exitcode == 0 and queue.get(timeout=5) is True
    opt.state_exporter.close()


def _wait_in_child(opt, queue) -> None:
    try:
        opt.wait_state_dict()
        queue.put("returned")
    except RuntimeError as e:
        queue.put(str(e))


def test_a_child_forked_during_a_background_export_is_told_instead_of_waiting_forever(monkeypatch):
    """The export's thread stays in the parent: the child's wait raises at once (broken on purpose, waiting on
    the parent's future: the child hangs); the parent's export completes as usual."""
    import multiprocessing as mp

    from optim_factory.optimizers.export import mixin

    gate = threading.Event()

    class Gated(mixin.StateExporter):
        def _stream_after(self, *args):
            gate.wait(60)
            return super()._stream_after(*args)

    monkeypatch.setattr(mixin, "StateExporter", Gated)
    opt = _optimizer(4 * M, reuse=False, background=True)
    reference = export_state(opt, cpu_offload=True)
    with opt.deferred_state_dict():  # returns unfilled: the export is held at the gate
        sd = opt.state_dict()
    assert opt.state_dict_pending
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_wait_in_child, args=(opt, queue), daemon=True)
    child.start()
    child.join(timeout=60)
    hung = child.is_alive()
    if hung:
        child.kill()
    gate.set()
    assert not hung, "the forked child waited for the parent's export"
    assert "forked" in queue.get(timeout=5)
    opt.wait_state_dict()
    assert_state_dicts_bitwise(sd, reference, "the parent's background export")
    opt.state_exporter.close()


def test_a_stager_on_shared_workers_leaves_them_running_also_after_a_failure():
    with UnstageWorkers(2) as workers:
        before = set(threading.enumerate())  # with the two workers
        dst = torch.zeros(SLOT_BYTES // 4 + M)
        with pytest.raises(ValueError, match="3 destination elements"):
            with Stager(4 * SLOT_BYTES, None, workers) as stager:
                stager.put(torch.ones(dst.numel()), dst)  # a sealed slot: its copy runs on a worker
                stager.put(torch.ones(4), torch.empty(3))
        assert torch.equal(dst[: SLOT_BYTES // 4], torch.ones(SLOT_BYTES // 4))
        assert workers.alive and not set(threading.enumerate()) - before
        src, out = torch.arange(3 * M, dtype=torch.int32), torch.empty(3 * M, dtype=torch.int32)
        with Stager(src.numel() * 4, None, workers) as stager:
            stager.put(src, out)
            stager.flush()
        assert torch.equal(out, src) and not set(threading.enumerate()) - before
    assert not set(threading.enumerate()) - before and not workers.alive
    with pytest.raises(ValueError, match=r"UnstageWorkers for device None \(alive=False\)"):
        Stager(M, None, workers)
    with pytest.raises(RuntimeError, match="closed, or started by another process"):
        workers.submit(print)


def test_workers_closed_during_an_export_fail_it_in_one_line_without_hanging():
    """The stager's queued ring jobs are cancelled when its workers are closed mid-export: close() must not wait
    for them (a cancelled job never completes), and the export fails with one line saying why. Broken on
    purpose (waiting for every ring job): close() hangs."""
    workers = UnstageWorkers(1)
    release = threading.Event()
    blocker = workers.submit(release.wait)  # the only thread is busy: the ring's jobs stay queued
    outcome: list[BaseException] = []

    def export() -> None:
        try:
            with Stager(4 * SLOT_BYTES, None, workers) as stager:
                probe = workers.submit(print)  # queued after the ring's jobs
                closing = threading.Thread(target=workers.close)  # cancels what is queued, then waits for the blocker
                closing.start()
                while not probe.cancelled():
                    time.sleep(0.01)
                release.set()
                closing.join()
                stager.put(torch.ones(4), torch.empty(4))
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome.append(e)

    runner = threading.Thread(target=export, daemon=True)  # a daemon: a hang fails the test, not the suite
    runner.start()
    runner.join(timeout=60)
    release.set()
    assert not runner.is_alive(), "Stager.close() hung on jobs that closed workers had cancelled"
    assert blocker.done() and len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "UnstageWorkers were closed during an export" in str(outcome[0])


def test_unstage_workers_name_the_device_when_a_thread_cannot_make_it_current(monkeypatch):
    before = set(threading.enumerate())

    def refuse(device):
        raise RuntimeError("no such device")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    with pytest.raises(RuntimeError, match=r"UnstageWorkers device=cuda:1: a thread could not make the device"):
        UnstageWorkers(3, torch.device("cuda", 1))
    assert not set(threading.enumerate()) - before


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_unstage_workers_refuse_a_bad_thread_count_in_one_line(bad):
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match=f"UnstageWorkers threads={bad!r}: expected an int >= 1"):
        UnstageWorkers(bad)
    assert not set(threading.enumerate()) - before
