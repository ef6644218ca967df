"""Passing a pool's fd over AF_UNIX: permissions, peer uid, hostile messages, a real handoff.

Run a child producer by hand: ``python -m tests.test_shm_fd producer SOCKET_PATH``.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import socket
import stat
import subprocess
import sys
import tempfile
import threading

import msgpack
import numpy as np
import pytest

from stagefeed.common.errors import BrokenError, ConfigError, DropReason, ProtocolError
from stagefeed.common.shm.fd_passing import (
    MAX_MESSAGE_BYTES,
    FdChannel,
    FdListener,
    accept_pool,
    offer_pool,
)
from stagefeed.common.shm.layout import SlotLayout
from stagefeed.common.shm.mapped import Descriptor
from stagefeed.common.shm.slots import SlotPool
from tests.conftest import REPO, cli_env

LAYOUT = SlotLayout.of([("x", np.uint8, (4096,)), ("y", np.int64, (4,))])


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def listener(tmp_path):
    listening = FdListener(str(tmp_path / "sock" / "pools.sock"))
    yield listening
    listening.close()


def raw_client(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def test_socket_is_0600_in_a_0700_directory_and_removed_on_close(tmp_path):
    old = os.umask(0)  # a careless umask must not loosen either mode
    try:
        listening = FdListener(str(tmp_path / "sock" / "pools.sock"))
    finally:
        os.umask(old)
    info = os.lstat(listening.path)
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "sock").st_mode) == 0o700
    listening.close()
    listening.close()
    assert not os.path.lexists(listening.path) and not os.path.exists(tmp_path / "sock")


def test_listener_refuses_an_open_directory_or_a_non_socket_path(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ConfigError, match="0700"):
        FdListener(str(shared / "pools.sock"))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "pools.sock").write_text("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        FdListener(str(private / "pools.sock"))


def test_stale_socket_of_a_killed_trainer_is_replaced(tmp_path):
    first = FdListener(str(tmp_path / "sock" / "pools.sock"))
    first._sock.close()  # killed: the file stays behind
    second = FdListener(first.path)
    with raw_client(second.path):
        assert second.accept(timeout=5).peer.pid == os.getpid()
    with pytest.raises(ConfigError, match="another process is listening"):
        FdListener(second.path)  # a live listener's socket is never taken over
    second.close()
    first.close()
    assert not os.path.lexists(first.path)
    assert not os.path.exists(tmp_path / "sock")  # the killed one's directory goes too


def test_hostile_messages_are_refused_and_every_fd_they_carry_is_closed(listener):
    before = open_fds()
    client = raw_client(listener.path)
    server = listener.accept(timeout=5)
    carried_r, carried_w = os.pipe()
    cases = [
        (DropReason.SHM_FD, msgpack.packb({"a": 1}), [carried_r, carried_w]),
        (DropReason.HEADER_SIZE, b"\x80" * (MAX_MESSAGE_BYTES + 1), [carried_r]),
        (DropReason.HEADER_NOT_MSGPACK, b"\xc1", [carried_r]),
        (DropReason.HEADER_NOT_MSGPACK, msgpack.packb(msgpack.ExtType(1, b"x")), [carried_r]),
        (DropReason.HEADER_NOT_MSGPACK, msgpack.packb({"a": 1}) + b"\x01", []),
        (DropReason.HEADER_NOT_MAP, msgpack.packb([1, 2]), [carried_w]),
    ]
    for reason, data, fds in cases:
        socket.send_fds(client, [data], fds)
        with pytest.raises(ProtocolError) as caught:
            server.recv(timeout=5)
        assert caught.value.reason is reason
    socket.send_fds(client, [msgpack.packb({"ok": True})], [])
    assert server.recv(timeout=5) == ({"ok": True}, None)  # boundaries kept: no desync
    os.close(carried_r)
    os.close(carried_w)
    client.close()
    with pytest.raises(BrokenError):
        server.recv(timeout=5)
    server.close()
    assert open_fds() - before == set()  # nothing leaked (others may have closed fds)


def test_recv_and_send_time_out_instead_of_hanging(listener):
    client = FdChannel.connect(listener.path, timeout=5)
    server = listener.accept(timeout=5)
    with pytest.raises(TimeoutError):
        server.recv(timeout=0.05)
    big = {"pad": b"x" * (MAX_MESSAGE_BYTES - 64)}
    with pytest.raises(TimeoutError):  # the server never reads: its buffer fills up
        for _ in range(10_000):
            client.send(big, timeout=0.05)
    assert server.recv(timeout=5)[0] == big  # what was sent arrived whole
    client.close()
    server.close()
    with pytest.raises(TimeoutError):
        listener.accept(timeout=0.05)


def test_trainer_refuses_a_bad_pool_and_the_producer_learns_why(listener):
    client = FdChannel.connect(listener.path, timeout=5)
    server = listener.accept(timeout=5)
    client.send({"v": 1, "pool": "p", "slots": 1, "layout": [["x", "|u1", [8]]]})  # no fd
    with pytest.raises(ProtocolError) as caught:
        accept_pool(server, lambda *a: None, timeout=5)
    assert caught.value.reason is DropReason.SHM_FD
    assert client.recv(timeout=5)[0]["reason"] == "shm_fd"
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, LAYOUT.stride)
    client.send({"v": 1, "pool": "p", "slots": 1, "layout": LAYOUT.to_wire()}, unsealed)
    with pytest.raises(ProtocolError) as caught:
        accept_pool(server, lambda *a: None, timeout=5)
    assert caught.value.reason is DropReason.SHM_SEALS
    assert client.recv(timeout=5)[0] == {"ok": False, "reason": "shm_seals",
                                        "detail": caught.value.detail}  # fmt: skip
    os.close(unsealed)
    with SlotPool(LAYOUT, 1) as pool:

        def refuse() -> None:
            _, fd = server.recv(timeout=5)
            cloexec.append(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
            os.close(fd)
            server.send({"ok": False, "reason": "test"})

        refuser = threading.Thread(target=refuse, name="shm-test-refuser")
        cloexec: list[int] = []
        refuser.start()
        with pytest.raises(BrokenError, match="refused"):
            offer_pool(client, pool, timeout=5)
        refuser.join(5)
        assert cloexec == [fcntl.FD_CLOEXEC]  # a received fd never leaks into exec'd children
    client.close()
    server.close()


def test_pool_handoff_to_a_real_producer_process(listener):
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.test_shm_fd", "producer", listener.path],
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        channel = listener.accept(timeout=30)
        assert channel.peer.pid == child.pid
        released = []

        def on_release(pool_id: str, slot: int, gen: int) -> None:
            released.append((pool_id, slot, gen))
            channel.send({"release": [slot, gen]})

        pool = accept_pool(channel, on_release, timeout=30)
        desc, fd = channel.recv(timeout=30)
        assert fd is None
        views = pool.view(Descriptor.parse(desc))
        assert np.all(views["x"] == 0xAB) and views["y"].tolist() == [0, 1, 2, 3]
        del views
        assert released == [(pool.pool_id, desc["slot"], desc["gen"])]
        assert channel.recv(timeout=30)[0] == {"released": True}
        out, _ = child.communicate(timeout=30)
        assert child.returncode == 0, out
        channel.close()
        pool.close()
    finally:
        child.kill()
        child.wait(10)


def _producer(path: str) -> None:
    """Child: offer a pool, publish one slot, answer the release, exit."""
    channel = FdChannel.connect(path, timeout=30)
    with SlotPool(LAYOUT, 2) as pool:
        offer_pool(channel, pool, timeout=30)
        slot = pool.acquire(timeout=5)
        arrays = pool.arrays(slot)
        arrays["x"][:] = 0xAB
        arrays["y"][:] = np.arange(4)
        channel.send(pool.commit(slot, seq=1))
        message, _ = channel.recv(timeout=30)
        channel.send({"released": pool.release(*message["release"])})
    channel.close()


def _nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another uid")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user")


def _connect_as(user: pwd.struct_passwd, path: str) -> int:
    """Fork a child that drops to ``user`` and connects to ``path``; returns its exit code:
    13 connect refused by permissions, 0 connected and then closed by the peer unread, 2 the
    peer answered, 1 anything else."""
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery from here on, leave through os._exit
        code = 1
        try:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(10)
            try:
                sock.connect(path)
            except PermissionError:
                os._exit(13)
            socket.send_fds(sock, [msgpack.packb({"hello": 1})], [0])
            code = 0 if sock.recv(100) == b"" else 2
        except (ConnectionResetError, BrokenPipeError):
            code = 0
        except BaseException:  # noqa: BLE001 - the child reports through its exit code
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_peer_with_another_uid_is_refused():
    nobody = _nobody()
    base = tempfile.mkdtemp(prefix="stagefeed-uid-", dir="/tmp")
    os.chmod(base, 0o711)  # others may traverse /tmp/X, not list it
    path = os.path.join(base, "sock", "pools.sock")
    listening = FdListener(path)
    try:
        # The 0700 directory is the first boundary: connect() itself is refused.
        assert _connect_as(nobody, path) == 13
        # SO_PEERCRED is the second: open the modes up as a misconfigured volume would.
        os.chmod(os.path.dirname(path), 0o711)
        os.chmod(path, 0o666)
        before = open_fds()
        done: list[object] = []
        acceptor = threading.Thread(
            target=lambda: done.append(_refusal(listening)), name="shm-test-accept"
        )
        acceptor.start()
        assert _connect_as(nobody, path) == 0  # closed unread
        acceptor.join(10)
        assert done == [DropReason.SHM_FD]
        assert open_fds() - before == set()  # nothing leaked (others may have closed fds)
        # Positive control: allowed explicitly, the same child is accepted with its uid.
        listening.allowed_uids = frozenset({os.geteuid(), nobody.pw_uid})

        def accept_and_close() -> None:
            channel = listening.accept(timeout=10)
            done.append(channel.peer.uid)
            channel.close()

        acceptor = threading.Thread(target=accept_and_close, name="shm-test-accept")
        acceptor.start()
        assert _connect_as(nobody, path) == 0
        acceptor.join(10)
        assert done[-1] == nobody.pw_uid
    finally:
        listening.close()
        os.rmdir(base)


def _refusal(listening: FdListener) -> object:
    try:
        listening.accept(timeout=10)
    except ProtocolError as exc:
        return exc.reason
    return "accepted"


if __name__ == "__main__":
    if sys.argv[1] == "producer":
        _producer(sys.argv[2])
