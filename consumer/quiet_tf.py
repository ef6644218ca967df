"""TensorFlow, imported once per process with its C++ start-up lines filtered.

Each place where stagefeed may load TensorFlow first in a process calls
``import_tensorflow()`` before anything imports it: the command line's trainer commands
(``stagefeed train``, ``run``, ``bench ingest``), the ``bench steps`` mode workers, and the
public API's lazily loaded trainer-side names (``stagefeed.ServedFeed`` in a notebook). A
process that imported TensorFlow itself keeps what it printed.

Why a filter: TensorFlow's shared libraries log while they load, before absl's logging is
initialised, so ``TF_CPP_MIN_LOG_LEVEL`` does not reach those lines. Where oneDNN's
optimisations are on by default (a CPU-dependent choice), each process prints
``port.cc:153] oneDNN custom operations are on ...`` twice, each time after absl's
``WARNING: All log messages before absl::InitializeLog() ...``. Turning oneDNN off
(``TF_ENABLE_ONEDNN_OPTS=0``) would silence them but change numerics, so instead stderr (the
file descriptor, which C++ writes to) goes through a pipe while ``import tensorflow`` runs:

- a glog-style line (``I0000 00:00:... file.cc:N] message``) below the severity that
  ``TF_CPP_MIN_LOG_LEVEL`` keeps (0: all, 1: no INFO, 2: no WARNING, 3: no ERROR; default 0,
  as in TensorFlow) is dropped, and so is absl's pre-initialisation notice;
- a kept glog line whose message was already printed is dropped (the second copy);
- every other line passes unchanged, in order.

Afterwards stderr is restored; nothing runs in the background. Later lines (after absl's
initialisation) are TensorFlow's own business: ``TF_CPP_MIN_LOG_LEVEL`` applies to them.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType

log = logging.getLogger(__name__)

# glog's prefix as TensorFlow's absl logging writes it: severity, MMDD, time, thread, source.
_GLOG = re.compile(rb"^([IWEF])\d{4} [\d:.]+\s+\d+ [\w.\-/]+:\d+\] (.*)$")
_SEVERITY = {b"I": 0, b"W": 1, b"E": 2, b"F": 3}
_ABSL_NOTICE = b"WARNING: All log messages before absl::InitializeLog() is called"
_READ_BYTES = 65536
_JOIN_S = 5.0


def min_log_level(environ: Mapping[str, str] = os.environ) -> int:
    """TensorFlow's own reading of ``TF_CPP_MIN_LOG_LEVEL``: an integer, 0 when unset or bad."""
    try:
        return int(environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


class StartupLineFilter:
    """Decides, line by line, what of TensorFlow's load-time output reaches stderr."""

    def __init__(self, level: int) -> None:
        self.level = level
        self._seen: set[bytes] = set()

    def keep(self, line: bytes) -> bool:
        """``line`` without its newline."""
        if line.startswith(_ABSL_NOTICE):
            return self.level < 1 and self._first(line)
        match = _GLOG.match(line)
        if match is None:
            return True
        if _SEVERITY[match.group(1)] < self.level:
            return False
        return self._first(match.group(1) + match.group(2))

    def _first(self, key: bytes) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


@contextmanager
def filtered_stderr(line_filter: StartupLineFilter) -> Iterator[None]:
    """Route file descriptor 2 through ``line_filter`` for the duration of the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    forwarder = threading.Thread(
        target=_forward, args=(read_end, saved, line_filter), name="stagefeed-tf-stderr"
    )
    forwarder.start()
    os.dup2(write_end, 2)
    os.close(write_end)  # fd 2 is now the pipe's only write end: restoring it ends the thread
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        forwarder.join(_JOIN_S)
        if forwarder.is_alive():  # a child process holds a write end: leave both fds to it
            log.warning("TensorFlow's start-up output is still being forwarded")
        else:
            os.close(read_end)
            os.close(saved)


def _forward(read_end: int, out: int, line_filter: StartupLineFilter) -> None:
    pending = b""
    while chunk := os.read(read_end, _READ_BYTES):
        *lines, pending = (pending + chunk).split(b"\n")
        _write_all(out, b"".join(line + b"\n" for line in lines if line_filter.keep(line)))
    if pending and line_filter.keep(pending):
        _write_all(out, pending)


def _write_all(out: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(out, view) :]


def import_tensorflow() -> ModuleType:
    """``import tensorflow``, through the filter the first time in this process."""
    loaded = sys.modules.get("tensorflow")
    if loaded is not None:
        return loaded
    began = time.monotonic()
    with filtered_stderr(StartupLineFilter(min_log_level())):
        import tensorflow
    log.info("TensorFlow %s loaded in %.1f s", tensorflow.__version__, time.monotonic() - began)
    return tensorflow

