"""A worker's stop or failure told to every worker, also to one that waits for data.

The cluster's vote (``collective_stop``) reaches a worker only at its next collective. A
worker whose feed has no batch (no producer yet, producers refused or slow) waits in its own
``get_next`` and never gets there, so a stop on another worker (SIGTERM to one pod) would leave
both waiting: the stopped one in the collective, this one for data. The news goes around the
collectives instead, through the coordination service's key-value store that
``MultiWorkerMirroredStrategy`` already runs (led by the chief or worker 0):

- ``tell(reason)``: a worker whose own verdict is ``STOP`` or ``FAIL`` writes the key ``KEY``
  ("worker I: REASON"); the first writer's value stays (a second write is refused, and
  ignored).
- ``heard()``: every worker's watcher looks for the key between its polls (a lookup with a
  ``LOOK_MS`` deadline); once it is there, the worker closes its queue, so a wait for data
  returns and the worker reaches the vote, where the stopped worker's vote ends the run for
  all at the same step.

The store is the cluster's, for its lifetime: a restarted cluster starts with none. If the
store cannot be reached (the leader gone: the cluster is broken, which the next collective
reports), ``heard`` logs it once and says nothing from then on.
"""

from __future__ import annotations

import logging

import tensorflow as tf
from tensorflow.python.eager import context

log = logging.getLogger(__name__)

KEY = "stagefeed/stop"
# How long one look waits for the key (milliseconds): a missing key costs this much.
LOOK_MS = 5


class PeerStop:
    """``tell`` and ``heard`` of the module docstring, for worker ``index``."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._context = context.context()
        self._reachable = True

    def tell(self, reason: str) -> None:
        """Let every worker know that this one ends the run, and why."""
        try:
            self._context.set_config_key_value(KEY, f"worker {self.index}: {reason}")
        except tf.errors.AlreadyExistsError:
            pass  # another worker told first: its news is the one every worker reads
        except tf.errors.OpError as exc:
            log.warning("cluster: cannot tell the other workers that this one stops (%s: %s)",
                        type(exc).__name__, exc.message[:200])  # fmt: skip

    def heard(self) -> str | None:
        """Another worker's news (``tell``), once it is there; None before."""
        if not self._reachable:
            return None
        try:
            return self._context.get_config_key_value(KEY, timeout_in_ms=LOOK_MS)
        except tf.errors.DeadlineExceededError:
            return None
        except tf.errors.OpError as exc:
            self._reachable = False
            log.warning("cluster: the coordination service cannot be reached to hear other "
                        "workers stop (%s: %s)", type(exc).__name__, exc.message[:200])  # fmt: skip
            return None
