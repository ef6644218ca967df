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

The end of the data (``end_watch=True``, the default): the thread ``stagefeed-feed-end``
consults the run's ``RunEnd`` (``consumer.run_end``, the CLI trainers' rule) every
``WATCH_S``. Once every producer that said hello and delivered has said ``end``, every batch
they sent is in the queue, and that held for ``end_grace_s`` (late producers may still say
hello), it closes the queue: the dataset yields what is queued, then ends (``fit`` stops at
the end of that epoch, a ``for`` loop over the dataset ends). A failed intake closes the queue
too and ``check()`` raises the failure. ``KerasTrainer`` watches its run itself
(``end_watch=False``: it adds a stop event and the producers' health to the same rule).

Resume (docs/resume.md, "A custom loop"): ``ServedFeed(options, positions=True)`` books, per
shard, the batches its steps trained (the steps booked with ``books.step_done()``, or by the
Keras callback); ``position()``, read after the user saved their model, is what that model has
trained. ``ServedFeed(options, resume=position)`` starts from it: a producer's welcome names
the first batch its shard still owes (a seekable source starts there), and a batch of the
position that comes again is dropped as ``already_trained``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from stagefeed.common.errors import ConfigError
from stagefeed.common.ledger import Ledger
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import InputPosition
from stagefeed.common.shard_books import ShardBooks
from stagefeed.consumer.intake.intake import Intake
from stagefeed.consumer.memory import malloc_policy
from stagefeed.consumer.run_end import Ending, RunEnd, finished_because
from stagefeed.consumer.tf2.feed import Feed

log = logging.getLogger(__name__)

END_GRACE_S = 1.0  # how long the data must stay ended before the dataset ends
WATCH_S = 0.1
JOIN_TIMEOUT_S = 3.0


class ServedFeed(Feed):
    """A ``Feed`` bound on ``options.bind``; ``ledger`` holds the books (a new one unless
    given), ``endpoint`` the address producers connect to. ``positions``: book the input
    position per shard (``position()``); ``resume``: an ``InputPosition`` (or its
    ``to_dict()``, e.g. read back from JSON) to start from, which implies ``positions``.
    ``confirm_saves``: the loop calls ``saved(position)`` after each checkpoint it writes, and
    a producer that finished stays until a saved position holds its whole shard (else it
    leaves once its ``end`` is delivered); implies ``positions``."""

    def __init__(
        self,
        options: TrainerOptions,
        configure_server: Callable[[Any], None] | None = None,
        ledger: Ledger | None = None,
        *,
        end_watch: bool = True,
        end_grace_s: float = END_GRACE_S,
        positions: bool = False,
        resume: InputPosition | Mapping[str, Any] | None = None,
        confirm_saves: bool = False,
    ) -> None:
        self.ledger = Ledger() if ledger is None else ledger
        if resume is not None or positions or confirm_saves:
            if self.ledger.shards is not None:
                raise ConfigError("resume/positions: the ledger given books positions already")
            if resume is not None and not isinstance(resume, InputPosition):
                resume = InputPosition.from_dict(resume, "ServedFeed(resume=...)")
            self.ledger.shards = ShardBooks(resume, confirms=confirm_saves)
            if resume is not None:
                log.info("the feed resumes from: %s", _describe(resume))
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
        self.options = options
        self._served_closed = False
        self._stop = threading.Event()
        self.run_end = RunEnd(
            self._stop, self.intake.data_ended, [self.intake.check], end_grace_s=end_grace_s
        )
        self._watch: threading.Thread | None = None
        if end_watch:
            self._watch = threading.Thread(
                target=self._watch_end, name="stagefeed-feed-end", daemon=True
            )
            self._watch.start()

    def check(self) -> None:
        """Raise ``BrokenError`` if the intake failed (call between epochs or steps)."""
        self.intake.check()

    def position(self) -> InputPosition:
        """What the booked steps trained, per shard (a copy): read it after saving the model,
        and pass it back as ``ServedFeed(options, resume=...)``. ``ConfigError`` if this feed
        books no positions (made without ``positions=True`` or ``resume``)."""
        return self._shard_books().position()

    def saved(self, position: InputPosition, finished: bool | None = None) -> None:
        """A checkpoint holding ``position`` (a ``position()`` read after its model) is
        written for good: the producers whose whole shard it holds may leave. ``finished``:
        the loop's last, of a run it will not resume: at ``close`` every producer may leave;
        None: as ``finished(position)`` says (the CLI trainers' rule). ``ConfigError`` if
        this feed books no positions."""
        if finished is None:
            finished = bool(self.finished(position))
        self._shard_books().saved(position, finished)

    def finished(self, position: InputPosition) -> str:
        """Why a run whose checkpoint holds ``position`` is done, or "" (``run_end.
        finished_because``, the CLI trainers' rule): every pass of ``options.epochs`` of a
        source with passes is trained, or every producer's data ended and all of it was
        trained. A loop's own plan of steps is the loop's to judge (``saved(p, True)``)."""
        drained = self.run_end.verdict.data_ended and self.figures().queued == 0
        return finished_because(step=0, planned_steps=0, planned_passes=self.options.epochs,
                                position=position, data_ended=drained)  # fmt: skip

    def _shard_books(self) -> ShardBooks:
        books = self.ledger.shards
        if books is None:
            raise ConfigError(
                "this feed books no input position: make it with ServedFeed(options, "
                "positions=True), or resume=POSITION"
            )
        return books

    def producer_name(self, peer: int) -> str:
        """The name the books give connection ``peer`` (a ``TrainedStep``'s ``peers``)."""
        return self.ledger.name(peer)

    def _watch_end(self) -> None:
        while not self._stop.wait(WATCH_S):
            verdict = self.run_end.poll()
            if verdict.ending is Ending.DRAIN:
                log.info("%s: the dataset ends once the queue is drained", verdict.reason)
            elif verdict.ending is Ending.FAIL:
                log.error("the feed failed (check() raises it): %s", verdict.reason)
            if verdict.ending is not Ending.RUNNING:
                self.queue.close()  # queued batches stay; the dataset ends after them
                return

    def close(self) -> None:
        if self._served_closed:
            return
        self._served_closed = True
        self._stop.set()
        if self._watch is not None:
            join_threads([self._watch], JOIN_TIMEOUT_S)
        self.intake.stop_granting()
        super().close()
        self.intake.close()


def _describe(position: InputPosition) -> str:
    """``shard 0 at 57 (+1 above), shard 1 at 96``: the first batch each shard still owes."""
    streams = [
        f"shard {shard} at {p.next}" + (f" (+{len(p.above)} above)" if p.above else "")
        for shard, p in sorted(position.streams.items())
    ]
    return ", ".join(streams) or "nothing trained yet"
