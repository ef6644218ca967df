"""The file behind a bound ``ipc://`` endpoint: libzmq creates it and never removes it.

libzmq 4.3.5 leaves the socket file in place when the socket closes (and replaces any file at
that path when it binds), so the owner of the bind removes it, and only it: the file is
recognised by the inode the bind created, so a later bind of the same path by another
process (which made a new file) is left alone.
"""

from __future__ import annotations

import logging
import os

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
