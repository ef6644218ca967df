"""The file behind a bound ``ipc://`` endpoint: libzmq creates it and never removes it.

libzmq 4.3.5 leaves the socket file in place when the socket closes (and replaces any file at
that path when it binds), so the owner of the bind removes it, and only it: the file is
recognised by the inode the bind created, so a later bind of the same path by another
process (which made a new file) is left alone.

A run killed with SIGKILL removes nothing: ``sweep_leftovers`` (``stagefeed run`` at start)
removes what killed runs left in the temp directory under ``run``'s own names,
``stagefeed-PID.sock`` (its control socket) and ``stagefeed-shm-PID/`` (its pool socket's
private directory), but only those of this user whose process ``PID`` is gone and whose socket
nobody listens on.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import tempfile
from collections.abc import Collection

log = logging.getLogger(__name__)

PREFIX = "ipc://"


class IpcFile:
    """Remembers the socket file of a bound endpoint; ``remove()`` deletes exactly that file.

    Endpoints that are not ipc, or in Linux's abstract namespace (``ipc://@name``), have no
    file: ``path`` is None and ``remove()`` does nothing. Call right after a successful bind.
    """

    def __init__(self, endpoint: str) -> None:
        self.path: str | None = None
        self._inode: int | None = None
        if endpoint.startswith(PREFIX) and not endpoint.startswith(PREFIX + "@"):
            path = endpoint[len(PREFIX) :]
            try:
                self._inode = os.stat(path).st_ino
                self.path = path
            except FileNotFoundError:
                log.warning("bound %s but found no socket file there", endpoint)

    def remove(self) -> None:
        """Idempotent."""
        if self.path is None:
            return
        unlink_if_ours(self.path, self._inode)
        self.path = None


def unlink_if_ours(path: str, inode: int | None) -> None:
    """Unlink ``path`` if it is still the file we made (same inode): a successor that bound
    the same path since keeps its socket file. Missing already: nothing to do."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


# ``run``'s own names in the temp directory (``stagefeed.loopback``): PID is the run's process.
_CONTROL = re.compile(r"stagefeed-([0-9]{1,9})\.sock")
_POOL_DIR = re.compile(r"stagefeed-shm-([0-9]{1,9})")
POOL_SOCKET = "pools.sock"


def sweep_leftovers(
    directory: str | None = None, only: Collection[int] | None = None
) -> list[str]:
    """Remove the socket files and pool directories that killed ``run`` processes left in
    ``directory`` (default: the temp directory; see the module docstring), of the processes
    ``only`` names if given; the names removed, said in one log line."""
    directory = directory or tempfile.gettempdir()
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        log.warning("cannot look for leftovers of killed runs in %s: %s", directory, exc)
        return []
    swept: list[str] = []
    for name in names:
        path = os.path.join(directory, name)
        control, pool = _CONTROL.fullmatch(name), _POOL_DIR.fullmatch(name)
        pid = int((control or pool)[1]) if control or pool else 0
        if only is not None and pid not in only:
            continue
        if control and _gone(pid) and _dead_socket(path, socket.SOCK_STREAM):
            _remove(path, swept, name)
        elif pool and _gone(pid) and _dead_pool_dir(path):
            inside = os.path.join(path, POOL_SOCKET)
            if os.path.lexists(inside):
                _remove(inside, swept, None)
            _remove(path, swept, name + "/")
    if swept:
        log.info("swept what killed runs left in %s: %s", directory, ", ".join(swept))
    return swept


def _gone(pid: int) -> bool:
    """No process ``pid`` (one of another user is alive: ``EPERM``)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def _ours(path: str, kind: int) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_IFMT(info.st_mode) == kind and info.st_uid == os.geteuid()


def _dead_socket(path: str, kind: int) -> bool:
    """``path`` is a socket file of ours that nobody listens on (connection refused)."""
    if not _ours(path, stat.S_IFSOCK):
        return False
    with socket.socket(socket.AF_UNIX, kind) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def _dead_pool_dir(path: str) -> bool:
    """``path`` is a directory of ours holding nothing but a pool socket nobody listens on."""
    if not _ours(path, stat.S_IFDIR):
        return False
    try:
        inside = os.listdir(path)
    except OSError:
        return False
    if not inside:
        return True
    own = os.path.join(path, POOL_SOCKET)
    return inside == [POOL_SOCKET] and _dead_socket(own, socket.SOCK_SEQPACKET)


def _remove(path: str, swept: list[str], name: str | None) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError as exc:
        log.warning("cannot remove %s, left by a killed run: %s", path, exc.strerror)
        return
    if name is not None:
        swept.append(name)
