"""Where a trainer offers shared-memory pools, and how big each producer's pool is.

No TensorFlow and no ZeroMQ here: the pool gate (``consumer.intake.shm_gate``) and anything that
reports on it import this.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile

from stagefeed.common.options import MIB


def default_socket_path(bind: str) -> str:
    """``$XDG_RUNTIME_DIR`` (when it is ours and private) or the temp dir, then
    ``stagefeed-UID/pools-<bind>.sock``: stable for one bind address, so a restarted trainer
    takes over the socket its killed predecessor left (``FdListener`` replaces a dead one)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or ""
    try:
        info = os.stat(base) if base else None
    except OSError:
        info = None
    if info is None or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        base = tempfile.gettempdir()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", bind.split("://", 1)[-1]).strip("-")[:40] or "any"
    return os.path.join(base, f"stagefeed-{os.geteuid()}", f"pools-{slug}.sock")


@dataclasses.dataclass(frozen=True)
class PoolSizing:
    """What each producer's pool holds (``shm_pool.pool_slots``), for logs and the summary."""

    slots: int
    stride: int
    producers: int

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.stride

    def describe(self) -> str:
        return (
            f"{self.slots} slots of {self.stride / MIB:.2f} MiB = {self.pool_bytes / MIB:.1f} MiB "
            f"per producer, {self.producers * self.pool_bytes / MIB:.1f} MiB for the "
            f"{self.producers} producer(s) it is sized for"
        )
