"""Stand-in for producer processes: one named thread putting a generator's batches into a feed.

The only place the examples fill a feed; the network intake replaces it (it calls the same
``feed.enqueue(arrays, peer, seq)`` from its enqueue threads).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping

import numpy as np

from stagefeed import Feed

log = logging.getLogger(__name__)


class ThreadFiller:
    """Enqueues ``batches`` as ``peer`` with seqs 0, 1, ... until they end or the feed closes.

    ``close_at_end``: close the feed once a finite source is exhausted, so the dataset (and
    ``fit``) ends after the last batch. ``stop()`` closes the feed (unblocking a waiting
    enqueue) and joins; an exception raised by the source is re-raised by ``stop()``/``join()``.
    """

    def __init__(
        self,
        feed: Feed,
        batches: Iterable[Mapping[str, np.ndarray]],
        *,
        peer: int = 0,
        close_at_end: bool = True,
        name: str = "stagefeed-filler",
    ) -> None:
        self.feed = feed
        self.batches = batches
        self.peer = peer
        self.close_at_end = close_at_end
        self.sent = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> ThreadFiller:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for arrays in self.batches:
                if not self.feed.enqueue(arrays, self.peer, self.sent):
                    return
                self.sent += 1
            if self.close_at_end:
                self.feed.close()
        except Exception as exc:  # noqa: BLE001 - handed to the thread that joins
            self._error = exc
            self.feed.close()

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the thread; re-raise the source's exception, if any."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s still running after %.1f s", self._thread.name, timeout)
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 10.0) -> None:
        """Close the feed (a blocked enqueue returns False) and join the thread."""
        self.feed.close()
        self.join(timeout)

    def __enter__(self) -> ThreadFiller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
