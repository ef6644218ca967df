"""One producer liveness check for every ``Trainer.train(health_check=...)`` that runs a pool.

``stagefeed run`` (``stagefeed.launcher``), ``bench ingest`` and the stagefeed mode of ``bench
steps`` each had their own copy (review finding 14); this is the one to call. It lives in
``bench/`` for now; it needs nothing of bench and can move next to ``ProducerPool`` as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from stagefeed.common.errors import BrokenError


class _Pool(Protocol):
    """What the check needs of a ``producer.pool.ProducerPool``."""

    def alive(self) -> int: ...

    def wait(self, timeout_s: float | None = None) -> bool: ...


def pool_check(pool: _Pool, ended: type[Exception] = BrokenError) -> Callable[[], None]:
    """A ``health_check`` that raises once no process of ``pool`` is alive.

    A producer that failed (non-zero exit) raises ``BrokenError`` naming it, from
    ``pool.wait(0)``. If every producer ended cleanly, ``ended("all producers ended")``:
    ``BrokenError`` where producers are meant to run until stopped (the benchmarks), or
    ``ClosedError`` where they may finish first (``stagefeed run --max-batches``: the launcher).
    While any producer is alive the check costs one ``is_alive()`` per process.
    """

    def check() -> None:
        if not pool.alive():
            pool.wait(0)  # raises BrokenError if any failed
            raise ended("all producers ended")

    return check
