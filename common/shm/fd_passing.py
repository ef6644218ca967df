"""Pass a pool's fd with a small msgpack header over an AF_UNIX SOCK_SEQPACKET socket.

The trainer listens on a socket file created 0600 inside a 0700 directory (the directory is
the boundary: only its owner can reach the socket); the file is removed on ``close()``. Each
accepted peer is checked with SO_PEERCRED: its uid must be in ``allowed_uids`` (default: the
listener's own uid) or the connection is closed unread.

One message is one msgpack map (at most ``MAX_MESSAGE_BYTES``) with at most one fd
(SCM_RIGHTS, as ``socket.send_fds``/``recv_fds`` send it; received fds are close-on-exec).
A message that is truncated, not msgpack, not a map, or carries more than one fd is refused
with ``ProtocolError``, and every fd it carried is closed. SEQPACKET keeps message
boundaries, so a refused message never desynchronizes the stream.

Handshake for a pool (the producer connects): ``offer_pool`` sends the announce with the fd
and waits for ``{"ok": true}`` or ``{"ok": false, "reason", "detail"}``; ``accept_pool`` maps
it (``MappedPool``) and answers. Keep the channel open: EOF tells the trainer the producer
has gone. Descriptors and releases travel elsewhere (ZeroMQ) as plain dicts.
"""

from __future__ import annotations

import array
import dataclasses
import logging
import os
import select
import socket
import stat
import struct
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgpack

from stagefeed.common.errors import BrokenError, ConfigError, DropReason, ProtocolError
from stagefeed.common.excerpt import excerpt
from stagefeed.common.ipc_file import unlink_if_ours
from stagefeed.common.protocol import refuse_ext
from stagefeed.common.shm.layout import PoolAnnounce
from stagefeed.common.shm.mapped import MappedPool, ReleaseHook
from stagefeed.common.shm.slots import SlotPool

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024
_UCRED = struct.Struct("3i")


@dataclasses.dataclass(frozen=True)
class PeerCred:
    """The peer process's credentials at connect time (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCred(*_UCRED.unpack(raw))


def _send_fds(sock: socket.socket, data: bytes, fds: list[int], flags: int) -> None:
    """``socket.send_fds`` with its ``flags`` honoured (Python 3.11 drops them)."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancillary, flags)


def _recv_fds(sock: socket.socket, bufsize: int, flags: int) -> tuple[bytes, list[int], int]:
    """``socket.recv_fds(sock, bufsize, 1, flags)`` with ``flags`` honoured (Python 3.11 drops
    them: without MSG_CMSG_CLOEXEC a received fd would leak into every child the trainer
    starts). Room for one fd: the kernel discards any more and sets MSG_CTRUNC."""
    fds = array.array("i")
    data, ancillary, msg_flags, _ = sock.recvmsg(bufsize, socket.CMSG_LEN(fds.itemsize), flags)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), msg_flags



def _private_dir(directory: str) -> bool:
    """Create ``directory`` 0700 (True), or check an existing one is ours and closed to
    others (False)."""
    try:
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # whatever the umask
        return True
    except FileExistsError:
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise ConfigError(
                f"socket directory {directory} must be a directory owned by uid {os.geteuid()} "
                f"with mode 0700 (is {stat.filemode(info.st_mode)}, uid {info.st_uid})"
            ) from None
    return False


def _remove_stale(path: str) -> None:
    """Unlink the socket a killed trainer left at ``path``; refuse a live one or a non-socket."""
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ConfigError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
            return
        except OSError as exc:
            raise ConfigError(
                f"{path}: cannot tell whether a trainer listens there: {exc}"
            ) from exc
    raise ConfigError(f"{path}: another process is listening there; pick another path")


class FdChannel:
    """One connected SEQPACKET socket. One thread may ``recv`` while others ``send`` (each
    message is sent atomically); not two receivers. ``close()`` is idempotent."""

    def __init__(self, sock: socket.socket, peer: PeerCred) -> None:
        self._sock = sock
        self.peer = peer

    @classmethod
    def connect(
        cls, path: str, timeout: float = 10.0, allowed_uids: Collection[int] | None = None
    ) -> FdChannel:
        """Connect to a listener; its uid must be in ``allowed_uids`` (default: ours)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.settimeout(None)
            peer = peer_cred(sock)
            if peer.uid not in (allowed_uids or {os.geteuid()}):
                raise ProtocolError(DropReason.SHM_FD, f"listener {path} runs as uid {peer.uid}")
        except BaseException:
            sock.close()
            raise
        return cls(sock, peer)

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(
        self, header: Mapping[str, Any], fd: int | None = None, timeout: float | None = 10.0
    ) -> None:
        """Send one message (and ``fd``, which stays the caller's). TimeoutError if the peer
        does not make room within ``timeout`` s, BrokenError if it has gone."""
        data = msgpack.packb(dict(header), use_bin_type=True)
        if len(data) > MAX_MESSAGE_BYTES:
            raise ValueError(f"message of {len(data)} bytes over {MAX_MESSAGE_BYTES}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                _send_fds(self._sock, data, [] if fd is None else [fd], socket.MSG_DONTWAIT)
                return
            except BlockingIOError:
                self._wait(select.POLLOUT, deadline, "room to send")
            except OSError as exc:
                raise BrokenError(f"fd channel to pid {self.peer.pid}: {exc}") from exc

    def _wait(self, event: int, deadline: float | None, what: str) -> None:
        """Poll (the socket stays blocking, so one thread may send while another receives)."""
        poller = select.poll()
        poller.register(self._sock, event)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not poller.poll(None if left is None else left * 1000):
            raise TimeoutError(f"fd channel, pid {self.peer.pid}: no {what} in time")

    def recv(self, timeout: float | None = None) -> tuple[dict[str, Any], int | None]:
        """The next message and its fd (caller owns it). TimeoutError if none in ``timeout``
        s, BrokenError when the peer has gone, ProtocolError (fds closed) if refused."""
        if timeout is not None:
            self._wait(select.POLLIN, time.monotonic() + timeout, "message")
        try:
            data, fds, flags = _recv_fds(self._sock, MAX_MESSAGE_BYTES, socket.MSG_CMSG_CLOEXEC)
        except OSError as exc:
            raise BrokenError(f"fd channel from pid {self.peer.pid}: {exc}") from exc
        try:
            if not data and not fds:
                raise BrokenError(f"pid {self.peer.pid} closed the fd channel")
            if flags & socket.MSG_TRUNC:
                raise ProtocolError(DropReason.HEADER_SIZE, f"over {MAX_MESSAGE_BYTES} bytes")
            if flags & socket.MSG_CTRUNC or len(fds) > 1:
                raise ProtocolError(DropReason.SHM_FD, "more than one fd in a message")
            try:
                header = msgpack.unpackb(data, raw=False, ext_hook=refuse_ext)
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                raise ProtocolError(DropReason.HEADER_NOT_MSGPACK, str(exc)) from exc
            if not isinstance(header, dict):
                raise ProtocolError(DropReason.HEADER_NOT_MAP, f"{type(header).__name__}")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return header, (fds[0] if fds else None)

    def close(self) -> None:
        self._sock.close()


class FdListener:
    """Listens at ``path``; the socket file is 0600 in a 0700 directory, removed by
    ``close()`` (idempotent) with the directory if this listener created it (or found it
    holding nothing but a stale socket at ``path``); a peer whose uid is not in
    ``allowed_uids`` is refused."""

    def __init__(
        self, path: str, allowed_uids: Collection[int] | None = None, backlog: int = 16
    ) -> None:
        self.path = os.path.abspath(path)
        self.allowed_uids = frozenset(allowed_uids or {os.geteuid()})
        directory = os.path.dirname(self.path)
        # Ours to remove at close: made here, or left empty but for this socket (by a killed
        # trainer at the same path), so a restart leaves nothing behind either.
        self._made_dir = _private_dir(directory) or set(os.listdir(directory)) <= {
            os.path.basename(self.path)
        }
        if os.path.lexists(self.path):
            _remove_stale(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(self.path)
            os.chmod(self.path, 0o600)  # before listen(): no one could connect yet
            self._inode: int | None = os.stat(self.path).st_ino
            self._sock.listen(backlog)
        except BaseException:
            self._sock.close()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self, timeout: float | None = None) -> FdChannel:
        """The next allowed peer. TimeoutError, or ProtocolError(SHM_FD) for a refused uid
        (its connection closed unread)."""
        self._sock.settimeout(timeout)
        try:
            conn, _ = self._sock.accept()
        except TimeoutError:
            raise TimeoutError(f"no connection at {self.path} in {timeout} s") from None
        peer = peer_cred(conn)
        if peer.uid not in self.allowed_uids:
            conn.close()
            log.warning("refused fd peer pid %d uid %d at %s", peer.pid, peer.uid, self.path)
            raise ProtocolError(DropReason.SHM_FD, f"peer pid {peer.pid} uid {peer.uid} refused")
        conn.settimeout(None)
        return FdChannel(conn, peer)

    def close(self) -> None:
        self._sock.close()
        if self._inode is None:
            return
        unlink_if_ours(self.path, self._inode)
        self._inode = None
        if self._made_dir:
            try:
                os.rmdir(os.path.dirname(self.path))
            except OSError:
                log.debug("left socket directory %s (not empty)", os.path.dirname(self.path))


def offer_pool(channel: FdChannel, pool: SlotPool, timeout: float = 10.0) -> None:
    """Producer: hand ``pool`` to the trainer; BrokenError if it refused the pool."""
    channel.send(pool.announce(), pool.fd)
    reply, fd = channel.recv(timeout)
    if fd is not None:
        os.close(fd)
    if reply.get("ok") is not True:
        raise BrokenError(f"trainer refused pool {pool.pool_id}: {refusal_text(reply)}")


def refusal_text(reply: Mapping[str, Any]) -> str:
    """What a peer's ``{"ok": false, "reason", "detail"}`` says, as bounded excerpts."""
    return f"{excerpt(reply.get('reason'), 40)}: {excerpt(reply.get('detail'), 300)}"


def accept_pool(
    channel: FdChannel,
    on_release: ReleaseHook,
    timeout: float | None = 10.0,
    check: Callable[[PoolAnnounce], None] | None = None,
    register: Callable[[MappedPool], None] | None = None,
) -> MappedPool:
    """Trainer: receive a pool announce + fd, map it, answer. Refusals are answered, then
    raised as ProtocolError; the fd is closed either way (the mapping keeps the memory).

    ``check(announce)`` may refuse a well-formed announce (raise ProtocolError) before the
    fd is mapped: the layout the trainer expects, the slots it granted. ``register(pool)``
    runs after mapping and before the answer: a producer told ``ok`` may send descriptors of
    the pool at once, so whatever routes them must know the pool by then."""
    header, fd = channel.recv(timeout)
    try:
        if fd is None:
            raise ProtocolError(DropReason.SHM_FD, "pool announce without an fd")
        try:
            announce = PoolAnnounce.from_wire(header)
            if check is not None:
                check(announce)
        except ProtocolError:
            os.close(fd)
            raise
        pool = MappedPool(fd, announce, on_release)  # owns fd from here on
        if register is not None:
            try:
                register(pool)
            except ProtocolError:
                pool.close()
                raise
    except ProtocolError as exc:
        channel.send({"ok": False, "reason": exc.reason.value, "detail": exc.detail})
        raise
    channel.send({"ok": True})
    return pool
