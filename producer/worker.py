"""One producer process: read batches from a source and send them to the trainer (protocol v2).

``produce(options, worker, stop)`` is the whole job and can run in any process (tests call
it in a thread); ``worker_main`` is the entry point ``Producers`` spawns around it: logging,
signals, orphan protection, exit codes, and the one-line failure it reports to the pool.

Flow: resolve the source (a bad ``--source`` fails before connecting), connect, hello,
welcome (which gives the schema when the producer declared none), open the source with that
schema, then send each batch after ``check_arrays`` (the first batch's mismatch is a
``SchemaMismatch`` naming source, array, expected and actual). The end of the data or
``max_batches`` is a clean finish: what is held is sent against credit, then ``end``, then
ZeroMQ delivers for up to ``FLUSH_TIMEOUT_S``. A source that fails finishes the same way
(the batches it made before are delivered), its ``end`` carrying ``source_error`` and the
error's text, and then the error is raised (exit 2 or 3). A stop discards what is held.

Resume (docs/resume.md): the hello names the shard (worker ``index`` of ``count``, global
across ``--shard-group``s: ``worker_info``) and whether its source can seek; the batches'
``seq`` is their place in the shard's stream. A welcome that carries a position (a trainer
with ``--save``) says where to start and which batches above to skip; the source is opened
there (``WorkerInfo.start``, or read from its first batch and fast-forwarded when it cannot
seek). A *later* welcome with a position (the trainer restarted, or the connection was
replaced) makes the producer rewind: it discards what it holds, closes the channel and starts
over on a new one, where the new welcome says. Such a trainer also says ``saved`` once a
complete checkpoint holds the shard's whole stream (the hello asks with ``confirm``): a
producer that finished waits for it before it leaves, so a trainer killed with the tail still
queued gets it again from here (it rewinds) rather than waiting for the shard.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import socket
import threading
import time
from typing import Any

from stagefeed.common import protocol
from stagefeed.common.errors import BrokenError, ClosedError, ConfigError
from stagefeed.common.lifecycle import STOP_SIGNALS
from stagefeed.common.logs import setup_logging
from stagefeed.common.options import ProducerOptions
from stagefeed.producer.channel import TrainerChannel
from stagefeed.producer.channel_contract import Channel
from stagefeed.producer.fanout import make_channel
from stagefeed.producer.process_pipes import WorkerReports
from stagefeed.producer.send_loop import Rewind, send_all
from stagefeed.producer.sources import (
    SourceFactory,
    SourceFailed,
    WorkerInfo,
    is_passing,
    is_seekable,
    resolve_source,
)

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0
LEAVING_LINGER_S = 1.0  # for ``leaving`` to reach a trainer that waits for it while closing
_flushing = threading.Event()


def producer_id(shard: int) -> str:
    """Unique per process run: host, pid, global shard and a nonce (no reuse after restart)."""
    host = "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())[:32]
    return f"{host}-{os.getpid()}-{shard}-{secrets.token_hex(2)}"


def worker_info(options: ProducerOptions, index: int) -> WorkerInfo:
    """What worker ``index`` of ``options.workers`` tells its source: its global shard,
    ``G + index * K`` of ``K * workers`` for ``--shard-group G/K``, and the seed
    ``seed + shard`` (each group draws other data; ``0/1``: shard ``index``, as before).

    Groups interleave (group ``G`` holds the shards ``= G mod K``, so the global batches ``=
    G mod K`` at any producer count): a cluster's checkpoint dealt out to another producer
    count then leaves every worker as many batches (``consumer.books.redeal`` says why)."""
    group, groups = options.shard_group
    shard = group + index * groups
    return WorkerInfo(shard, groups * options.workers, producer_id(shard), options.seed + shard)


def group_fields(options: ProducerOptions) -> dict[str, int]:
    """The hello's ``group_first``/``group_shards``/``group_stride``: the shards of this
    ``produce`` command (``worker_info``), which a cluster worker waits for once one of them
    delivered."""
    group, groups = options.shard_group
    return {"group_first": group, "group_shards": options.workers, "group_stride": groups}


class _ParentWatch:
    """The worker's stop condition: the pool's shared flag, a signal to this process, or the
    death of the parent (no orphans left running).

    A signal only sets ``signalled``, a plain attribute: a handler that did more (a log line,
    a lock) could deadlock the code it interrupted. The shared flag is a pipe
    (``process_pipes.StopFlag``), which also reads as set once the parent has died.
    """

    def __init__(self, stop: Any) -> None:
        self._stop = stop
        self._parent = os.getppid()
        self.signalled = False

    def is_set(self) -> bool:
        return self.signalled or self._stop.is_set() or os.getppid() != self._parent


def worker_main(
    options: ProducerOptions,
    index: int,
    stop: Any,
    log_level: int,
    reports: WorkerReports | None = None,
) -> None:
    """Entry point of a spawned producer process: exit 0 on a clean finish or stop, 2 on a
    ``ConfigError``, 3 on a ``BrokenError``; in every case it reports to ``reports`` how it
    ended (the error in one line), what it sent and what its ``end`` said."""
    setup_logging(log_level)
    watch = _ParentWatch(stop)

    def on_signal(*_: object) -> None:
        # The first signal stops this producer; a second one, or one while the last batches
        # are being delivered (ZeroMQ linger inside ``Context.term``), discards them: exit.
        if _flushing.is_set():
            # The main thread sits in Context.term (ZeroMQ's linger): it holds no log lock.
            log.info("producer %d: stop requested while delivering the last batches: "
                     "discarded", index)  # fmt: skip
            os._exit(0)
        if watch.signalled:
            os._exit(0)
        watch.signalled = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # The pool starts workers with both signals blocked (see producer.pool): handlers first.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    outcome = Outcome()
    code, state, error = 1, "failed", "unexpected error (see the producer's log)"
    try:
        produce(options, worker_info(options, index), watch, outcome)
        code, state, error = 0, "finished", ""
    except ClosedError:
        code, state, error = 0, "stopped", ""
    except (ConfigError, BrokenError) as exc:
        log.debug("producer %d failed: %s", index, exc)
        code, error = (2 if isinstance(exc, ConfigError) else 3), str(exc)
    finally:
        # CPython puts the default actions back while it exits, and a late Ctrl-C would then
        # turn this exit into a death by SIGINT, which the pool would report as a failure.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if reports is not None:
            try:
                reports.report(
                    index, code, state, outcome.sent, outcome.refused, outcome.bye, error,
                    outcome.trainers,
                )  # fmt: skip
            except OSError as exc:  # the pool has gone: nobody to tell
                log.debug("producer %d: no report: %s", index, exc)
    if code:
        raise SystemExit(code)


@dataclasses.dataclass
class Outcome:
    """What one ``produce`` did, filled in as it goes (for its report to the pool):
    ``sent`` batches handed over (seq 0..sent-1), the trainer's ``refused`` verdicts by
    reason, ``bye``: the reason its ``end`` carried, once that went out (None: no end), and
    ``trainers``: per trainer endpoint, batches given to ZeroMQ for it and connections lost."""

    sent: int = 0
    refused: dict[str, int] = dataclasses.field(default_factory=dict)
    bye: str | None = None
    trainers: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    next_seq: int = 0  # the shard's stream position after the last batch handed over


def produce(
    options: ProducerOptions, worker: WorkerInfo, stop: Any, outcome: Outcome | None = None
) -> int:
    """Send batches until ``max_batches``, the source's end, or ``stop``; return the count.

    Raises ``ClosedError`` on stop, ``ConfigError`` (``SchemaMismatch``) when the trainer or
    the source disagree with the schema, ``BrokenError`` when the trainer refuses the
    handshake or the source fails. A source that fails (at start or at batch ``k``) is a
    finish first: the ``k`` batches before the failure are delivered, then ``end`` tells the
    trainer ``source_error`` and the error's text; then the source's error is raised.
    """
    from stagefeed.producer.data.named import data_source  # numpy only until it reads

    factory = data_source(options) or resolve_source(options.source)
    if is_passing(factory) and len(options.connect) > 1:
        raise ConfigError(f"--source {options.source}: a source with passes feeds one trainer, "
                          f"not {len(options.connect)}")  # fmt: skip
    outcome = outcome if outcome is not None else Outcome()
    # One token for the producer run, on every channel it opens: after a rewind the trainer
    # knows the new connection for the run that delivered on the old one (its ``end`` ends
    # what the old one sent; consumer/books/ledger.py ``delivered``).
    session = secrets.token_hex(16)
    while True:
        try:
            return _produce_once(options, worker, stop, outcome, factory, session)
        except Rewind:
            log.info("producer %s: the trainer moved shard %d of %d: starting again where it "
                     "says", worker.producer_id, worker.index, worker.count)  # fmt: skip


def _produce_once(
    options: ProducerOptions,
    worker: WorkerInfo,
    stop: Any,
    outcome: Outcome,
    factory: SourceFactory | None,
    session: str,
) -> int:
    """``produce`` over one channel (its hello carries the run's ``session`` token);
    ``Rewind`` (what it held discarded) when a later welcome moved this shard."""
    configure = None
    passes = {"passes": True} if is_passing(factory) else {}
    from stagefeed.producer.data.source import MapSource  # numpy only until it reads

    # The data's order: a trainer may deal its checkpoint out to another producer count.
    order = factory.hello_fields() if isinstance(factory, MapSource) else {}
    if options.curve_keys:
        from stagefeed.common.curve import client_configurator

        configure = client_configurator(options.curve_keys)
    channel = make_channel(
        options, worker.producer_id, configure,
        hello_fields={"shard": worker.index, "shards": worker.count, "session": session,
                      "seek": is_seekable(factory), "confirm": True, **passes,
                      **group_fields(options), **order},
    )  # fmt: skip
    name = worker.producer_id
    failure: ConfigError | BrokenError | None = None
    finished = rewound = False
    try:
        welcome = channel.open(stop)
        try:
            send_all(options, worker, factory, channel, welcome, stop, outcome)
        except SourceFailed as failed:
            failure = failed.error
        except Rewind:
            rewound = True
            raise
        try:
            # A data source's skipped records: in our last line, and told to the trainer.
            note = getattr(factory, "report", lambda: "")()
            bad = getattr(factory, "skipped", lambda: (0, ""))()
            outcome.bye = _finish(channel, name, outcome, stop, failure, note, bad)
            finished = True
            if failure is None and channel.repositioned is not None:
                # A trainer that came back while we finished: what it lost is sent again.
                rewound = True
                raise Rewind()
        except ClosedError:
            if failure is None:
                raise  # a stop while delivering the tail of a failed source: its error stands
    finally:
        if not finished and not rewound and channel.welcome is not None:
            log.info(
                "producer %s stopped: %d batches handed over (%s); %s; %d not yet delivered "
                "discarded (%d waiting for credit, %d held by ZeroMQ)",
                name,
                outcome.sent,
                _seq_range(outcome.sent, outcome.next_seq),
                _refused_text(channel),
                channel.held(),
                channel.waiting(),
                channel.in_zeromq(),
            )
        outcome.refused = channel.refused()
        outcome.trainers = channel.trainers()
        channel.close()
    if failure is not None:
        raise failure
    return outcome.sent


def _finish(
    channel: Channel,
    name: str,
    outcome: Outcome,
    stop: Any,
    failure: ConfigError | BrokenError | None = None,
    note: str = "",
    bad: tuple[int, str] = (0, ""),
) -> str | None:
    """Deliver what is held, then ``end`` (with ``source_error`` and the text of ``failure``
    if the source failed), then let ZeroMQ deliver for what is left of ``FLUSH_TIMEOUT_S``.
    A trainer that confirms (``TrainerChannel.confirms``) is waited for after a clean ``end``,
    until a checkpoint of it holds the whole shard (``_wait_saved``).
    Returns the reason the ``end`` carried, or None if it could not be sent."""
    started = time.monotonic()
    reason = protocol.END_OK if failure is None else protocol.END_SOURCE_ERROR
    # ``end {seq}``: where the stream ends (a resumed shard's first batches were not sent here)
    drained = channel.finish(
        outcome.next_seq, stop, FLUSH_TIMEOUT_S, reason, str(failure or ""), bad
    )
    if failure is None and channel.repositioned is not None:
        return None  # a later welcome moved this shard: the caller rewinds, nothing is lost
    linger_s = max(0.0, FLUSH_TIMEOUT_S - (time.monotonic() - started))
    refused = sum(channel.refused().values())
    log.log(
        logging.WARNING if refused or failure or note else logging.INFO,
        "producer %s %s: %d batches (%s); %s; delivering the last %d (up to %.0f s)",
        name,
        "finished" if failure is None else "source failed, ending",
        outcome.sent,
        _seq_range(outcome.sent, outcome.next_seq),
        _refused_text(channel) + (f"; {note}" if note else ""),
        channel.in_zeromq(),
        linger_s,
    )
    if drained.unsent:
        log.warning(
            "producer %s: the last %d batches were never sent (no credit from the trainer at "
            "%s within %.0f s); end not sent",
            name,
            drained.unsent,
            channel.endpoint,
            FLUSH_TIMEOUT_S,
        )
    confirmable = drained.end_sent and failure is None and isinstance(channel, TrainerChannel)
    if confirmable and _wait_saved(channel, name, outcome.next_seq, stop):
        linger_s = max(linger_s, LEAVING_LINGER_S)  # ``leaving``: the trainer waits for it
    _flushing.set()
    try:
        channel.close(linger_s)
    finally:
        _flushing.clear()
    return reason if drained.end_sent else None


def _wait_saved(channel: TrainerChannel, name: str, end: int, stop: Any) -> bool:
    """Stay until the trainer lets this producer go: its checkpoint holds the whole stream
    (``end`` batches), or its run is finished (its ``bye`` says so); True then, and
    ``leaving`` is on its way. False after a stop (logged: run it again if that trainer
    restarts) or when a later welcome moved the shard (the caller rewinds)."""
    if not channel.confirms:
        return False
    log.info("producer %s: waiting until a checkpoint of the trainer holds all %d batches (a "
             "trainer restarted before that gets the rest from here)", name, end)  # fmt: skip
    try:
        saved = channel.wait_saved(end, stop)
    except ClosedError:
        log.info("producer %s stopped before the trainer saved all %d batches: run it again if "
                 "that trainer restarts", name, end)  # fmt: skip
        return False
    if saved:
        log.info("producer %s: the trainer saved all %d batches", name, end)
    return channel.repositioned is None  # let go (``saved``, or a finished run): ``leaving``


def _seq_range(count: int, end: int | None = None) -> str:
    """``seq A..B`` of the last ``count`` batches before ``end`` (default: ``count``)."""
    end = count if end is None else end
    if count > end:  # a rewind sent some again
        return f"seq 0..{end - 1}, some of them again after a rewind"
    return f"seq {end - count}..{end - 1}" if count else "none"


def _refused_text(channel: Channel) -> str:
    """``trainer refused 3 (value_range: 2, spec_mismatch: 1)``, the biggest reason first."""
    counts = channel.refused()
    total = sum(counts.values())
    if not total:
        return "trainer refused 0"
    parts = ", ".join(f"{r}: {n}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"trainer refused {total} ({parts})"
