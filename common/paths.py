"""Output paths checked at start, by creating them.

A run that trains for an hour and then cannot write ``--json /proc/x.json`` loses its summary,
so every path a command will write is tried before anything starts: the only reliable test of
"writable" is writing (permissions, read-only mounts, /proc, a full disk's inode table and
root's exemptions all show there). A failure is a ``ConfigError`` naming the flag and the path.
"""

from __future__ import annotations

import logging
import os
import tempfile

from stagefeed.common.errors import ConfigError

log = logging.getLogger(__name__)


def check_writable_file(flag: str, path: str) -> str:
    """Return ``path`` once a file there could be created (or opened for appending).

    Its directory must exist. A file the check created is removed again, so a run that ends
    before writing leaves nothing behind; an existing file is not changed.
    """
    _check_named(flag, path, "a file")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a directory; name a file")
    existed = os.path.lexists(path)
    try:
        # O_NONBLOCK: a FIFO without a reader fails at once instead of blocking the start.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        raise ConfigError(f"{flag} {path!r} cannot be written: {exc.strerror or exc}") from None
    os.close(fd)
    if not existed:
        try:
            os.unlink(path)
        except OSError:
            pass  # it can stay: the summary overwrites it
    return path


def check_writable_dir(flag: str, path: str) -> str:
    """Return ``path`` once it is a directory (created with its parents if missing) in which a
    file could be created; the probe file is removed, the directory stays. Parents created
    are said in one log line (a typo in a parent makes a new tree)."""
    _check_named(flag, path, "a directory")
    created = _first_missing_parent(path)
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".stagefeed-write-check-", dir=path)
    except OSError as exc:
        why = exc.strerror or exc
        raise ConfigError(f"{flag} {path!r} is not a writable directory: {why}") from None
    os.close(fd)
    os.unlink(probe)
    if created is not None:
        log.warning("%s %r: %s did not exist: created, with the folders below it (a typo?)",
                    flag, path, created)  # fmt: skip
    return path


def _first_missing_parent(path: str) -> str | None:
    """The outermost missing folder above ``path`` (None: its parent exists)."""
    missing = None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        missing = parent
        parent = os.path.dirname(parent)
    return missing


def _check_named(flag: str, path: object, what: str) -> None:
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise ConfigError(f"{flag} must name {what}, got {path!r}")
