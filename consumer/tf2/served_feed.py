"""``ServedFeed``: a TF 2 ``Feed`` whose batches come from producers over the network.

The five lines of a Keras user::

    options = stagefeed.TrainerOptions(bind="tcp://*:5555", schema=schema)
    with stagefeed.ServedFeed(options) as feed:          # producers connect to options.bind
        model.fit(feed.dataset(("images", "labels")), steps_per_epoch=100, epochs=3,
                  callbacks=[feed.callback()])
        print(feed.ledger.summary())                     # every batch: trained, queued, dropped

The intake (``consumer.intake.intake``) binds, speaks the protocol, checks every batch against the
schema and enqueues into the feed's queue (capacity from ``options.queue_mb``); the feed's
books report each step's batches to the same ``Ledger``. As the graph trainer does, a feed whose
``options.keep_freed_memory`` is set (the default) applies ``consumer.memory.malloc_policy`` to the
process: freed batch-sized buffers (received frames, the queue's copies, the batches the
pipeline hands the step) are reused instead of unmapped and faulted in again, which measured
13-15% of a Keras AlexNet step on 2 cores (docs/benchmarks.md). Lifecycle: construct (binds) ->
``dataset()`` once -> train -> ``close()`` (idempotent: no more credit, the queue closes so
blocked enqueues return, the intake's threads are joined).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stagefeed.common.ledger import Ledger
from stagefeed.common.options import TrainerOptions
from stagefeed.consumer.intake.intake import Intake
from stagefeed.consumer.memory import malloc_policy
from stagefeed.consumer.tf2.feed import Feed


class ServedFeed(Feed):
    """A ``Feed`` bound on ``options.bind``; ``ledger`` holds the books (a new one unless
    given), ``endpoint`` the address producers connect to."""

    def __init__(
        self,
        options: TrainerOptions,
        configure_server: Callable[[Any], None] | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.ledger = Ledger() if ledger is None else ledger
        super().__init__(
            options.schema,
            options.queue_capacity,
            stage_depth=options.stage_depth,
            device=options.device,
            sink=self.ledger,
        )
        if options.keep_freed_memory:
            malloc_policy.keep_freed_memory(options.schema.largest_array_bytes)
        self.intake = Intake(options, options.schema, self.enqueue, self.ledger, configure_server)
        try:
            self.intake.start()
        except BaseException:
            super().close()
            raise
        self.endpoint = self.intake.endpoint
        self._served_closed = False

    def check(self) -> None:
        """Raise ``BrokenError`` if the intake failed (call between epochs or steps)."""
        self.intake.check()

    def close(self) -> None:
        if self._served_closed:
            return
        self._served_closed = True
        self.intake.stop_granting()
        super().close()
        self.intake.close()
