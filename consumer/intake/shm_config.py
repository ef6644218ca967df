"""Where a trainer offers shared-memory pools (sizing is ``common.shm.sizing``).

No TensorFlow and no ZeroMQ here: the pool gate (``consumer.intake.shm_gate``) and anything that
reports on it import this.
"""

from __future__ import annotations

import os
import re
import tempfile


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
