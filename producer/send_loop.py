"""The producer's send loop: open the source where the welcome says, hand its batches to the
channel, pass after pass for a source that makes passes.

``send_all`` runs on the producer's main thread between the first welcome and ``end``
(``producer.worker``). Resume (docs/resume.md): the welcome's ``start`` and ``skip`` are
places in the shard's whole stream (``seq``); a seekable source is opened at ``start``, any
other is read from its first batch and what the trainer has is discarded.

Passes (docs/resume.md, "Passes"): a source with ``passes = True`` is called once per pass
with ``worker.epoch`` set (its ``start`` counts from the pass's first batch). After a pass's
last batch the channel says ``end_pass {seq, pass}`` and waits for the trainer's next pass,
so no batch of pass ``k + 1`` is made before every shard ended pass ``k``. ``seq`` goes on
along the stream across passes; the welcome says which pass to make, where it starts, and
how many passes the trainer trains (after the last one the producer says ``end``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from stagefeed.common.errors import BrokenError, ClosedError, ConfigError
from stagefeed.common.options import MIB, ProducerOptions
from stagefeed.common.position import skip_of
from stagefeed.producer import shm_send
from stagefeed.producer.channel_contract import Channel
from stagefeed.producer.handoff import Welcome
from stagefeed.producer.sources import (
    BatchStream,
    SourceFactory,
    SourceFailed,
    WorkerInfo,
    is_seekable,
    open_stream,
)

if TYPE_CHECKING:
    from stagefeed.producer.worker import Outcome

log = logging.getLogger(__name__)


class Rewind(Exception):
    """A later welcome moved this shard (``TrainerChannel.repositioned``): start over."""


def send_all(
    options: ProducerOptions,
    worker: WorkerInfo,
    factory: SourceFactory | None,
    channel: Channel,
    welcome: Welcome,
    stop: Any,
    outcome: Outcome,
) -> None:
    """Open the source where the welcome says and hand its batches to the channel until its
    end (its last pass) or ``max_batches``; ``SourceFailed`` when the source fails
    (``outcome.sent``: the batches before it), ``Rewind`` when a later welcome moved this
    shard."""
    schema, max_unsent = welcome.schema, welcome.max_unsent
    start, skip = welcome.resume or (0, [])
    seekable = is_seekable(factory)
    skipped = set(skip_of(skip))
    pass_, base, pass_count = welcome.passes or (0, 0, 1)
    while True:
        at = dataclasses.replace(worker, start=max(0, start - base) if seekable else 0,
                                 epoch=pass_)  # fmt: skip
        try:
            stream = open_stream(
                options.source, schema, at, max_unsent + 1, factory, options.short_batch
            )
        except (ConfigError, BrokenError) as exc:
            raise SourceFailed(exc) from exc
        log.info(
            "producer %s -> %s: %s (%.1f MiB a batch), at most %d held, source %s%s%s%s",
            worker.producer_id, ", ".join(options.connect), schema.describe(),
            schema.batch_bytes / MIB, max_unsent, options.source,
            # The global shard (``--shard-group``), always: which of several ``produce``
            # commands' streams this is, resumed or not.
            f"; shard {worker.index} of {worker.count}",
            f" from batch {start}" if welcome.resume else "",
            f"; pass {pass_} of {pass_count} from batch {base}" if welcome.passes else "",
        )  # fmt: skip
        ended = _send_stream(options, stream, base + at.start, (start, skipped), channel, welcome,
                           stop, outcome)  # fmt: skip
        if not ended or welcome.passes is None:
            return
        last = pass_ + 1 >= pass_count  # then ``end`` follows: nothing to wait for
        channel.end_pass(outcome.next_seq, pass_, stop, wait=not last)  # type: ignore[attr-defined]
        if last:
            return
        if channel.repositioned is not None:
            raise Rewind()
        pass_, base = pass_ + 1, outcome.next_seq


def _send_stream(
    options: ProducerOptions,
    stream: BatchStream,
    seq: int,
    resume: tuple[int, set[int]],
    channel: Channel,
    welcome: Welcome,
    stop: Any,
    outcome: Outcome,
) -> bool:
    """Send ``stream``'s batches as ``seq``, ``seq + 1``, ...; True at its end, False at
    ``max_batches``. ``resume``: the welcome's start and the batches above it not to send."""
    start, skipped = resume
    outcome.next_seq = seq
    interval = 1.0 / options.rate if options.rate else 0.0
    next_at = time.monotonic()
    while not options.max_batches or outcome.sent < options.max_batches:
        if stop.is_set():
            raise ClosedError("stop requested")
        if channel.repositioned is not None:
            raise Rewind()
        if seq < start or seq in skipped:  # trained already (or in flight): not sent again
            if not _discard(stream):
                return True
            seq += 1
            outcome.next_seq = seq
            continue
        if interval:
            next_at = _pace(next_at, interval, stop)
        if channel.lane is not None:
            slot = shm_send.send_in_slot(channel, stream, seq, stop)
            if slot == shm_send.END:
                return True
            if slot != shm_send.NOT_SHARED:
                outcome.sent += slot == shm_send.SENT
                # A lost batch (its trainer went away) keeps its place in a positioned stream
                # (the next welcome rewinds it); else its seq is reused, as ever.
                if slot == shm_send.SENT or welcome.resume is not None:
                    seq += 1
                outcome.next_seq = seq
                continue
        item = _next(stream)
        if item is None:
            return True
        arrays, release = item
        channel.send(arrays, seq, stop, on_release=release)
        outcome.sent += 1
        seq += 1
        outcome.next_seq = seq
    return False


def _next(stream: BatchStream) -> Any:
    """``stream.next()``; the source's own failure raised as ``SourceFailed`` (it ends the
    stream after the good batches are delivered)."""
    try:
        return stream.next()
    except (ConfigError, BrokenError) as exc:
        raise SourceFailed(exc) from exc


def _discard(stream: BatchStream) -> bool:
    """Read one batch and drop it (a batch the trainer has): False at the end of the data."""
    item = _next(stream)
    if item is None:
        return False
    if item[1] is not None:
        item[1]()
    return True


def _pace(next_at: float, interval: float, stop: Any) -> float:
    delay = next_at - time.monotonic()
    while delay > 0 and not stop.is_set():
        time.sleep(min(delay, 0.1))
        delay = next_at - time.monotonic()
    return max(next_at + interval, time.monotonic() - interval)
