"""A save handed to its writer process with its storages' descriptors beside the pickle (``_shared_send.py``): every
storage once, mapped on the other side without a copy, no descriptor left open by the hand-over, at most one more
than the storages held while they are mapped, and torch's own way under the ``file_system`` strategy."""

from __future__ import annotations

import gc
import glob
import multiprocessing
import os
import resource
import socket
import threading
import time

import pytest
import torch

from optim_factory.checkpoint._shared_send import discard, pickle_with_fds, recv_with_fds, send_with_fds
from tests import forked
from tests.distributed.launch import PRELOAD

pytestmark = pytest.mark.skipif(
    torch.multiprocessing.get_sharing_strategy() != "file_descriptor", reason="the file_descriptor sharing strategy"
)


@pytest.fixture(autouse=True, scope="module")
def _forkserver_with_torch():
    """The children fork from this process's forkserver: started with torch imported, each starts at once."""
    forked.start_forkserver(PRELOAD)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _received(obj):
    """``obj`` sent on one end of a pipe and received on the other (the receiver on a thread: the pickle can fill the
    socket's buffer); the receiver's exception is raised here."""
    sender, receiver = multiprocessing.Pipe()
    out: list = []

    def receive() -> None:
        try:
            out.append(recv_with_fds(receiver))
        except BaseException as exc:  # noqa: BLE001  (raised by the test's thread)
            out.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    pickled = pickle_with_fds(obj)
    send_with_fds(sender, pickled)
    thread.join(60)
    sender.close()
    receiver.close()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0], pickled


def test_every_storage_goes_once_beside_the_pickle_and_is_mapped_not_copied():
    shared = [torch.full((64,), float(i)).share_memory_() for i in range(300)]  # more than one message's 250
    base = torch.arange(16.0).share_memory_()
    plain = torch.arange(8.0)  # not in shared memory yet: moved there, as torch's own pickler moves it
    state = {
        "shared": shared,
        "views": (base[:8], base[8:]),
        "plain": (plain[:4], plain[4:]),  # its address changes as it moves: still one storage
        "empty": torch.empty(0),
        "meta": torch.empty(4, device="meta"),
        "step": 7,
    }
    got, pickled = _received(state)
    assert len(pickled.descriptors) == 300 + 1 + 1  # each storage once, nothing for the empty or the meta tensor
    assert [float(t[0]) for t in got["shared"]] == [float(i) for i in range(300)]
    for name in ("views", "plain"):
        first, second = got[name]
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr(), name
    assert torch.equal(torch.cat(got["views"]), base) and torch.equal(torch.cat(got["plain"]), plain)
    assert got["empty"].numel() == 0 and got["meta"].is_meta and got["step"] == 7
    shared[299].fill_(-1.0)  # the same memory on both sides
    base[9] = 100.0
    plain[5] = 50.0
    assert float(got["shared"][299][5]) == -1.0 and float(got["views"][1][1]) == 100.0
    assert float(got["plain"][1][1]) == 50.0


def _descriptors_of(tensors: list[torch.Tensor]) -> int:
    """How many descriptors this process holds open on the shared-memory files of ``tensors`` (whatever else other
    threads of the test's worker open or close meanwhile)."""
    files = {os.fstat(t.untyped_storage()._share_fd_cpu_()[0])[1:3] for t in tensors}  # (inode, device)
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.stat(f"/proc/self/fd/{fd}")[1:3] in files
        except OSError:  # closed meanwhile (the listing's own descriptor, another thread's)
            pass
    return found


def test_the_hand_over_leaves_no_descriptor_open():
    tensors = [torch.zeros(32).share_memory_() for _ in range(20)]
    assert _descriptors_of(tensors) == 20  # each storage's own
    got, _ = _received(tensors)
    assert _descriptors_of(tensors) == 40  # and each one mapped on the other side, as torch's does
    del got
    gc.collect()
    assert _descriptors_of(tensors) == 20


def test_a_default_socket_timeout_leaves_the_pipe_blocking():
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30.0)  # a socket made under it is non-blocking: the pipe's descriptor would be too
    try:
        sender, receiver = multiprocessing.Pipe()
        for _ in range(2):
            send_with_fds(sender, pickle_with_fds([torch.ones(4).share_memory_()]))
            assert float(recv_with_fds(receiver)[0].sum()) == 4.0
        assert os.get_blocking(receiver.fileno()) and os.get_blocking(sender.fileno())
    finally:
        socket.setdefaulttimeout(previous)


def _fds_open() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # not the listing's own


def _receive(receiver, room: int, report) -> None:
    """The child of :func:`_receive_under_a_limit`: its open-files limit leaving ``room`` free descriptor numbers
    below it (the limit bounds a new descriptor's number); then a second message on the same pipe (whether it
    serves on)."""
    opened = _fds_open()
    probes = [os.dup(0) for _ in range(room + 1)]  # the lowest free numbers, in order
    for fd in probes:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probes[room], resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        got = recv_with_fds(receiver)
        line = f"received {len(got)}"
        del got
    except BaseException as exc:  # noqa: BLE001
        line = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    gc.collect()
    line += f"; left open {_fds_open() - opened}; then {recv_with_fds(receiver)}"
    report.send(line)


def _receive_under_a_limit(count: int, room: int) -> str:
    """``count`` storages received by a child (forked from the forkserver: no thread of this process in it) whose
    open-files limit leaves it ``room`` descriptors beyond those it has open: its outcome's line, how many descriptors
    it left open, and the next message on the pipe."""
    tensors = [torch.zeros(4).share_memory_() for _ in range(count)]
    context = multiprocessing.get_context("forkserver")
    sender, receiver = context.Pipe()
    report, reported = context.Pipe()
    child = context.Process(target=_receive, args=(receiver, room, reported))
    child.start()
    receiver.close()
    reported.close()
    send_with_fds(sender, pickle_with_fds(tensors))
    send_with_fds(sender, pickle_with_fds("next"))
    line = report.recv() if report.poll(60) else "no report"
    child.join(60)
    return line


@pytest.mark.slow  # child processes
def test_a_save_is_received_with_one_descriptor_more_than_its_storages():
    assert _receive_under_a_limit(100, 100 + 1) == "received 100; left open 0; then next"
    assert _receive_under_a_limit(100, 100).endswith("; left open 0; then next")  # the mapping's duplicate refused


@pytest.mark.slow  # a child process
def test_descriptors_cut_short_by_the_limit_are_one_line_none_stays_open_and_the_pipe_serves_on():
    line = _receive_under_a_limit(100, 40)
    assert line.startswith("OSError: a save's shared-memory file descriptors did not all arrive (open-files limit ")
    assert line.endswith("; left open 0; then next"), line


def _send_under_a_limit(sender, report, messages: list, limit: int | None, nobody: bool) -> None:
    """The child of :func:`_start_sending`: each of ``messages`` pickled (a range: that many shared tensors, each
    holding its number), then its open-files limit lowered (to ``limit``, else to the lowest free descriptor number:
    nothing more can open), as ``nobody`` where asked and it can (Linux exempts root from the count of descriptors
    in flight), then the messages sent; its outcome's line reported."""
    pickled = [
        pickle_with_fds([torch.full((4,), float(i)).share_memory_() for i in m] if isinstance(m, range) else m)
        for m in messages
    ]
    if limit is None:
        limit = os.dup(0)  # the number the next descriptor would get
        os.close(limit)
    if nobody and os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        for one in pickled:
            send_with_fds(sender, one)
        line = "sent"
    except BaseException as exc:  # noqa: BLE001
        line = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    report.send(line)


def _start_sending(messages: list, limit: int | None = None, nobody: bool = False):
    """A child (forked from the forkserver) sending ``messages`` under a limit (:func:`_send_under_a_limit`): (the
    pipe's receiving end, the child's report, the child)."""
    context = multiprocessing.get_context("forkserver")
    sender, receiver = context.Pipe()
    report, reported = context.Pipe()
    child = context.Process(target=_send_under_a_limit, args=(sender, reported, messages, limit, nobody))
    child.start()
    sender.close()
    reported.close()
    return receiver, report, child


def _numbers(received: list[torch.Tensor]) -> list[float]:
    return [float(t[0]) for t in received]


@pytest.mark.slow  # a child process
def test_a_sender_at_its_open_files_limit_sends_whole_messages():
    """Sending opens no descriptor (the storages' own go): a training process at its limit still hands a save over
    whole, and the pipe stays in step."""
    receiver, report, child = _start_sending([range(10), "next"])
    line = report.recv() if report.poll(60) else "no report"
    assert line == "sent", line
    assert _numbers(recv_with_fds(receiver)) == [float(i) for i in range(10)]
    assert recv_with_fds(receiver) == "next"
    child.join(60)


@pytest.mark.slow  # a child process
def test_a_sender_past_the_limit_of_descriptors_in_flight_waits_for_the_receiver():
    """Descriptors sent and not yet received count against the sender's open-files limit (every process of its user
    together: the ranks of a node): a message past it waits until the receiver takes what is in flight. Here a
    child whose limit is 32 sends two messages of 40 storages, the second while the first's are in flight."""
    receiver, report, child = _start_sending([range(40), range(40, 80)], limit=32, nobody=True)
    time.sleep(0.5)  # the second message meets the limit meanwhile
    assert _numbers(recv_with_fds(receiver)) == [float(i) for i in range(40)]
    line = report.recv() if report.poll(60) else "no report"
    assert line == "sent", line
    assert _numbers(recv_with_fds(receiver)) == [float(i) for i in range(40, 80)]
    child.join(60)


def test_the_end_of_the_requests_is_none():
    sender, receiver = multiprocessing.Pipe()
    sender.send(None)
    assert recv_with_fds(receiver) is None
    sender.close()
    receiver.close()


def test_under_the_file_system_strategy_storages_go_by_name_and_an_unsent_pickle_lets_go_of_them():
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        mine = f"/dev/shm/torch_{os.getpid()}_*"
        before = set(glob.glob(mine))
        tensor = torch.arange(8.0)
        got, pickled = _received([tensor])
        assert pickled.descriptors == [] and torch.equal(got[0], tensor)
        del got, tensor, pickled
        unsent = torch.arange(8.0)
        discard(pickle_with_fds([unsent]))  # refused on another rank: never sent
        del unsent
        gc.collect()
        assert set(glob.glob(mine)) <= before
    finally:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
