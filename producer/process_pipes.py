"""What a producer pool shares with its worker processes: a stop flag and the workers'
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

import json
from collections.abc import Mapping
from typing import Any

from stagefeed.common.errors import BrokenError, ConfigError, StagefeedError

# A pipe write of at most PIPE_BUF (4096 on Linux) bytes is atomic: reports from several
# workers at once never interleave. Header (4 bytes) + the JSON text.
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


class WorkerReports:
    """Each worker's last words, one report at its end, carried to the pool over a pipe: how
    it ended (exit code; ``finished``, ``stopped`` or ``failed``; the one-line error), what it
    sent and what the trainer refused, and the reason its ``end`` carried
    (``Producers.books``, ``stagefeed produce``'s error line).

    Only our own processes write to it, and only JSON text (``MAX_REPORT_BYTES`` at most, one
    atomic pipe write): nothing is unpickled, and a report that does not parse as one of ours
    is ignored. The pool side keeps the first failure reported: the one ``stagefeed produce``
    prints as ``stagefeed: error: ...`` and whose exit code (2 or 3) it returns.
    """

    def __init__(self, ctx: Any) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._reports: dict[int, dict[str, Any]] = {}
        self._first: StagefeedError | None = None

    def report(
        self,
        worker: int,
        code: int,
        state: str,
        sent: int,
        refused: Mapping[str, int],
        bye: str | None,
        error: str = "",
        trainers: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        """Worker side: send the report (``error`` cut so the whole fits one atomic write).
        ``trainers``: per trainer endpoint, ``{"sent": n, "lost": k}``."""
        fields = {"worker": worker, "code": code, "state": state, "sent": sent,
                  "refused": dict(refused), "bye": bye,
                  "trainers": {e: dict(t) for e, t in (trainers or {}).items()}}  # fmt: skip
        data = json.dumps({**fields, "error": error}).encode()
        while len(data) > MAX_REPORT_BYTES:  # the error cut by a quarter until it fits
            error = error[: len(error) * 3 // 4]
            data = json.dumps({**fields, "error": error}).encode()
        self._writer.send_bytes(data)

    def read(self) -> None:
        """Pool side: take every report that has arrived (never blocks)."""
        while self._reader is not None and self._reader.poll(0):
            try:
                payload = self._reader.recv_bytes()
            except EOFError:  # every writer has gone: nothing more can come
                break
            report = _parse(payload)
            if report is None:
                continue
            self._reports.setdefault(report["worker"], report)
            if self._first is None and report["code"] in (2, 3) and report["error"]:
                text = report["error"]
                self._first = ConfigError(text) if report["code"] == 2 else BrokenError(text)

    def first(self) -> StagefeedError | None:
        """Pool side: the first failure reported, as the ``ConfigError``/``BrokenError``."""
        self.read()
        return self._first

    def of(self, worker: int) -> dict[str, Any] | None:
        """Pool side: worker ``worker``'s report, if it has come (``read()`` first)."""
        return self._reports.get(worker)

    @property
    def reader(self) -> Any:
        """The pool's end, to wait on (``multiprocessing.connection.wait``)."""
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        return {"_reader": None, "_writer": self._writer, "_reports": {}, "_first": None}


_REPORT_TYPES = {
    "worker": int, "code": int, "state": str, "sent": int, "refused": dict, "error": str,
}  # fmt: skip


def _parse(payload: bytes) -> dict[str, Any] | None:
    """A report as ``WorkerReports.report`` wrote it, or None."""
    try:
        report = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(report, dict) or not all(
        isinstance(report.get(k), t) for k, t in _REPORT_TYPES.items()
    ):
        return None
    if not (report.get("bye") is None or isinstance(report["bye"], str)):
        return None
    report["refused"] = {k: v for k, v in report["refused"].items() if isinstance(v, int)}
    trainers = report.get("trainers")
    report["trainers"] = {
        endpoint: {k: v for k, v in figures.items() if isinstance(v, int)}
        for endpoint, figures in (trainers.items() if isinstance(trainers, dict) else ())
        if isinstance(figures, dict)
    }
    return report
