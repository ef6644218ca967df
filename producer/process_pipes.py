"""What a producer pool shares with its worker processes: a stop flag and the failure
reports, each over an anonymous pipe.

Nothing here is named: multiprocessing's ``Event``, ``Lock`` and ``Queue`` are built on POSIX
named semaphores (``/dev/shm/sem.mp-*``), which only the pool's finalizers or its resource
tracker unlink. A process tree killed whole with SIGKILL (tracker included) left them behind,
three to seven per producer. A pipe is a pair of file descriptors: the kernel frees it with
the last process that holds it, whatever kills them.

Both objects travel to spawned workers as ``Process`` arguments (multiprocessing passes the
pipe's fd to the child) and carry only the end the worker needs.
"""

from __future__ import annotations

from typing import Any

from stagefeed.common.errors import BrokenError, ConfigError, StagefeedError

# A pipe write of at most PIPE_BUF (4096 on Linux) bytes is atomic: reports from several
# workers at once never interleave. Header (4 bytes) + code (1) + text.
MAX_REPORT_BYTES = 4000


class StopFlag:
    """A flag the pool sets once and its workers poll: ``set()`` writes a byte to the pipe,
    ``is_set()`` is true once the read end is readable. It is readable at EOF too: when every
    write end has closed (the pool's process died), the workers see the flag set.
    """

    def __init__(self, ctx: Any) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)

    def set(self) -> None:
        if self._writer is not None and not self._writer.closed:
            self._writer.send_bytes(b"stop")

    def is_set(self) -> bool:
        return self._reader.poll(0)

    def __getstate__(self) -> dict[str, Any]:
        return {"_reader": self._reader, "_writer": None}  # a worker only reads


class FailureReports:
    """Workers' fatal errors, one line each, carried to the pool over a pipe.

    Only our own processes write to it, and only ``(exit code, message text)`` as bytes: the
    text was written by us (it may quote the trainer's detail); nothing is unpickled. The pool
    side (``first()``) keeps the first report: that is the one ``stagefeed produce`` prints as
    ``stagefeed: error: ...`` and whose exit code (2 or 3) it returns.
    """

    def __init__(self, ctx: Any) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._first: StagefeedError | None = None

    def report(self, error: StagefeedError) -> None:
        """Worker side: send ``error``'s code and message (cut to one atomic pipe write)."""
        code = 2 if isinstance(error, ConfigError) else 3
        text = str(error).encode("utf-8", "replace")[: MAX_REPORT_BYTES - 1]
        self._writer.send_bytes(bytes([code]) + text)

    def first(self) -> StagefeedError | None:
        """Pool side: the first failure reported, as the ``ConfigError``/``BrokenError``."""
        while self._first is None and self._reader is not None and self._reader.poll(0):
            try:
                payload = self._reader.recv_bytes()
            except EOFError:  # every writer has gone: nothing more can come
                break
            text = payload[1:].decode("utf-8", "replace")
            self._first = ConfigError(text) if payload[0] == 2 else BrokenError(text)
        return self._first

    def __getstate__(self) -> dict[str, Any]:
        return {"_reader": None, "_writer": self._writer, "_first": None}  # a worker only writes
