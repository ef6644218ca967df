"""Shared-memory faults with real processes: kill -9 mid-write, truncation, full memory,
and the content canary that proves slots are released only when the consumer is done.

Children run as ``python -m tests.test_shm_faults ROLE SOCKET_PATH [ARGS]``.
"""

from __future__ import annotations

import collections
import errno
import mmap
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from stagefeed.common.errors import BrokenError, ConfigError, DropReason, ProtocolError
from stagefeed.common.shm.fd_passing import FdChannel, FdListener, accept_pool, offer_pool
from stagefeed.common.shm.layout import PoolAnnounce, SlotLayout
from stagefeed.common.shm.mapped import Descriptor, MappedPool
from stagefeed.common.shm.slots import SlotPool, reserve
from tests.conftest import REPO, cli_env

MIB = 2**20
LAYOUT = SlotLayout.of([("x", np.uint8, (MIB,)), ("y", np.int64, (8,))])
POISON = 0xEE


def fill(arrays: dict[str, np.ndarray], seq: int) -> None:
    arrays["x"].fill(seq % 251)
    arrays["y"].fill(seq)


def intact(views: dict[str, np.ndarray], seq: int) -> bool:
    """Every byte of the slot is what ``fill`` wrote for ``seq``."""
    return bool(np.all(views["x"] == seq % 251) and np.all(views["y"] == seq))


@pytest.fixture
def spawn(tmp_path):
    """``spawn(role, *args)`` -> (Popen, FdChannel) once the child connected; killed at end."""
    listener = FdListener(str(tmp_path / "sock" / "pools.sock"))
    children: list[subprocess.Popen] = []

    def _spawn(role: str, *args: object) -> tuple[subprocess.Popen, FdChannel]:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.test_shm_faults", role, listener.path, *map(str, args)],
            cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        children.append(child)
        return child, listener.accept(timeout=60)

    yield _spawn
    for child in children:
        child.kill()
        child.communicate(timeout=10)
    listener.close()


def test_producer_killed_mid_write_leaves_no_torn_slot_and_nothing_in_dev_shm(spawn):
    before = set(os.listdir("/dev/shm"))
    child, channel = spawn("torn")
    released: list[tuple[str, int, int]] = []
    pool = accept_pool(channel, lambda *a: released.append(a), timeout=60)
    first, second = channel.recv(timeout=30)[0], channel.recv(timeout=30)[0]
    torn = channel.recv(timeout=30)[0]["writing"]
    links = [
        os.readlink(f"/proc/{child.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{child.pid}/fd")
    ]
    assert [link for link in links if link.startswith("/memfd:stagefeed-")], links
    held = pool.view(Descriptor.parse(first))
    # It has written the torn slot (whole, then on without end) and says so: killed after that.
    assert channel.recv(timeout=30)[0] == {"written": torn["slot"]}
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=10)
    assert child.returncode == -signal.SIGKILL
    new = set(os.listdir("/dev/shm")) - before
    assert not [name for name in new if not name.startswith("sem.mp-")], new  # others' locks
    with pytest.raises(ProtocolError) as caught:
        pool.view(Descriptor.parse(torn))
    assert caught.value.reason is DropReason.SHM_UNCOMMITTED
    late = pool.view(
        Descriptor.parse(second)
    )  # accepted after its producer died: the mapping is ours
    assert intact(held, 1) and intact(late, 2)
    del held, late
    assert len(released) == 2
    with pytest.raises(BrokenError):
        channel.send({"release": [first["slot"], first["gen"]]})
    pool.close()


def _torn(channel: FdChannel) -> None:
    with SlotPool(LAYOUT, 4) as pool:
        offer_pool(channel, pool, timeout=30)
        for seq in (1, 2):
            slot = pool.acquire(timeout=5)
            fill(pool.arrays(slot), seq)
            channel.send(pool.commit(slot, seq))
        slot = pool.acquire(timeout=5)
        torn = {"pool": pool.pool_id, "slot": slot, "gen": pool.generation(slot), "seq": 3}
        channel.send({"writing": torn})  # the descriptor commit() would have sent
        arrays = pool.arrays(slot)
        fill(arrays, 3)
        channel.send({"written": slot})
        k = 1
        while True:  # killed in here
            fill(arrays, 3 + k % 2)
            k += 1


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "unsealed-control"])
def test_a_producer_cannot_truncate_its_pool_under_a_reader(spawn, sealed):
    child, channel = spawn("reader", "sealed" if sealed else "raw")
    if sealed:
        pool = SlotPool(LAYOUT, 2)
        fd = pool.fd
        slot = pool.acquire(timeout=5)
        fill(pool.arrays(slot), 7)
        offer_pool(channel, pool, timeout=30)
        channel.send(pool.commit(slot, 7))
    else:  # what a plain shm file allows: proves the reader would SIGBUS
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        reserve(fd, 2 * LAYOUT.stride)
        channel.send({"raw": 2 * LAYOUT.stride}, fd)
    assert channel.recv(timeout=30)[0] == {"mapped": True}
    errnos = []
    for size in (4 * LAYOUT.stride, LAYOUT.stride, 0):  # grow, shrink, empty
        try:
            os.ftruncate(fd, size)
            errnos.append(0)
        except OSError as exc:
            errnos.append(exc.errno)
    channel.send({"go": True})
    out, _ = child.communicate(timeout=30)
    if sealed:
        assert errnos == [errno.EPERM] * 3
        assert child.returncode == 0, out
        assert "read 1048576 bytes of 7, intact True" in out
        pool.close()
    else:
        assert errnos == [0, 0, 0]
        assert "refused: shm_seals" in out
        assert child.returncode == -signal.SIGBUS, out
        os.close(fd)


def _reader(channel: FdChannel, mode: str) -> None:
    if mode == "sealed":
        views = accept_pool(channel, lambda *a: None, timeout=30).view(
            Descriptor.parse(channel.recv(30)[0])
        )
        channel.send({"mapped": True})
        channel.recv(timeout=30)
        seq = int(views["y"][0])
        print(f"read {views['x'].size} bytes of {seq}, intact {intact(views, seq)}", flush=True)
        return
    header, fd = channel.recv(timeout=30)
    try:
        MappedPool(os.dup(fd), PoolAnnounce("raw", 2, LAYOUT), lambda *a: None)
    except ProtocolError as exc:
        print(f"refused: {exc.reason.value}", flush=True)
    memory = np.frombuffer(mmap.mmap(fd, header["raw"], prot=mmap.PROT_READ), np.uint8)
    print(f"mapped raw, sum {int(memory.sum())}", flush=True)
    channel.send({"mapped": True})
    channel.recv(timeout=30)
    print(f"read after truncate: {int(memory.sum())}", flush=True)  # SIGBUS here


def test_fallocate_on_a_full_tmpfs_is_a_config_error_naming_the_size(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr!r}")
    try:
        fd = os.open(mnt / "pool", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 16 * MIB)  # the pitfall: a sparse file "fits", the first write SIGBUSes
        with pytest.raises(ConfigError, match=r"16\.0 MiB \(16777216 bytes\).*ENOSPC"):
            reserve(fd, 16 * MIB, what="pool file")
        os.close(fd)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_pool_over_rlimit_fsize_is_a_config_error_naming_the_size():
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_shm_faults", "fsize", "-"],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "needs 32.0 MiB" in done.stdout and "EFBIG" in done.stdout
    assert "fds leaked: 0" in done.stdout


def _fsize() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8 * MIB, 8 * MIB))
    fds = len(os.listdir("/proc/self/fd"))
    try:
        SlotPool(SlotLayout.of([("x", np.uint8, (8 * MIB - 64,))]), 4)
    except ConfigError as exc:
        print(exc)
        print(f"fds leaked: {len(os.listdir('/proc/self/fd')) - fds}")
        return
    sys.exit("no ConfigError")


class Inbox:
    """The consumer's side of the canary channel: descriptors in order, acks set aside."""

    def __init__(self, channel: FdChannel) -> None:
        self.channel = channel
        self.messages: collections.deque[dict] = collections.deque()
        self.acked: set[tuple[int, int]] = set()

    def _pull(self) -> None:
        message, fd = self.channel.recv(timeout=30)
        assert fd is None
        if "poisoned" in message:
            self.acked.add(tuple(message["poisoned"]))
        else:
            self.messages.append(message)

    def next(self) -> dict:
        while not self.messages:
            self._pull()
        return self.messages.popleft()

    def wait_ack(self, key: tuple[int, int]) -> None:
        while key not in self.acked:
            self._pull()


def run_canary(spawn, early_release: bool, slots: int = 4, total: int = 300) -> dict:
    """Consume ``total`` batches through a pool of ``slots``, holding ``slots - 1`` views
    (a queue) and checking every byte of each batch when it leaves the queue.

    The producer poisons a slot the moment its release arrives, then acknowledges. Before
    checking a batch whose release was already sent, the consumer waits for that ack: so a
    release sent too early is detected every time, not by luck of timing.
    """
    child, channel = spawn("canary", slots, total)
    inbox, sent, finalized = Inbox(channel), set(), []

    def on_release(pool_id: str, slot: int, gen: int) -> None:
        finalized.append((slot, gen))
        if not early_release:  # the finalizer is the release signal
            channel.send({"release": [slot, gen]})

    pool = accept_pool(channel, on_release, timeout=60)
    held: collections.deque = collections.deque()
    checked = bad = 0

    def consume() -> None:
        nonlocal checked, bad
        seq, key, views = held.popleft()
        if key in sent:
            inbox.wait_ack(key)
        checked += 1
        bad += not intact(views, seq)

    while "done" not in (message := inbox.next()):
        views = pool.view(Descriptor.parse(message))
        key = (message["slot"], message["gen"])
        if early_release:
            channel.send({"release": list(key)})
            sent.add(key)
        held.append((message["seq"], key, views))
        del views
        if len(held) > slots - 1:
            consume()
    while held:
        consume()
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, out
    pool.close()
    return {"checked": checked, "bad": bad, "finalized": len(finalized), "log": out}


def check_canary(result: dict, total: int = 300) -> None:
    assert result["checked"] == total and result["finalized"] == total
    assert result["bad"] == 0, f"{result['bad']} of {result['checked']} batches corrupted"


@pytest.mark.parametrize("early_release", [False, True], ids=["finalizer", "early-release"])
def test_content_canary_slots_are_rewritten_only_after_the_consumer_is_done(spawn, early_release):
    result = run_canary(spawn, early_release)
    assert "reused slots 296" in result["log"]
    if early_release:  # the same check must fail when the release is sent too early
        with pytest.raises(AssertionError, match="corrupted"):
            check_canary(result)
    else:
        check_canary(result)


def _canary(channel: FdChannel, slots: int, total: int) -> None:
    """Child: publish ``total`` batches; poison each slot the moment it is released."""
    stop = threading.Event()
    with SlotPool(LAYOUT, slots) as pool:
        offer_pool(channel, pool, timeout=30)
        writable = {}

        def on_releases() -> None:
            while not stop.is_set():
                try:
                    message, _ = channel.recv(timeout=0.2)
                except TimeoutError:
                    continue
                slot, gen = message["release"]
                views = writable[slot]
                views["x"].fill(POISON)
                views["y"].fill(-1)
                assert pool.release(slot, gen)
                channel.send({"poisoned": [slot, gen]})

        releaser = threading.Thread(target=on_releases, name="shm-canary-release")
        releaser.start()
        acquired = set()
        for seq in range(total):
            slot = pool.acquire(timeout=30)
            acquired.add(slot)
            writable[slot] = pool.arrays(slot)
            fill(writable[slot], seq)
            channel.send(pool.commit(slot, seq))
        channel.send({"done": total})
        deadline = time.monotonic() + 30
        while pool.free_slots() < slots and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        releaser.join(5)
        free = pool.free_slots()
        print(f"reused slots {total - len(acquired)}, free at end {free}")
        writable.clear()
    channel.close()
    if releaser.is_alive() or free != slots:
        sys.exit("release thread stuck or slots never released")


if __name__ == "__main__":
    role, path, *rest = sys.argv[1:]
    if role == "fsize":
        _fsize()
        sys.exit(0)
    connected = FdChannel.connect(path, timeout=30)
    {"torn": _torn, "reader": _reader, "canary": _canary}[role](
        connected, *[int(a) if a.isdigit() else a for a in rest]
    )
