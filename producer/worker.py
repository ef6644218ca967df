"""One producer process: read batches from a source and push them to the trainer."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from typing import Any

import zmq
from stagefeed.common import protocol
from stagefeed.common.errors import BrokenError, ClosedError, ConfigError
from stagefeed.common.lifecycle import STOP_SIGNALS
from stagefeed.common.logs import setup_logging
from stagefeed.common.options import ProducerOptions
from stagefeed.producer.sender import BatchSender
from stagefeed.producer.sources import open_source

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0
POLL_S = 0.1


def producer_id(index: int) -> str:
    """Unique per process run: host, pid, worker index and a nonce (no reuse after restart)."""
    host = "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())[:32]
    return f"{host}-{os.getpid()}-{index}-{secrets.token_hex(2)}"


class _Stop:
    """The worker's stop condition: the pool's shared flag, a signal to this process, or the
    death of the parent (no orphans left running).

    A signal only sets ``signalled``, a plain attribute: the shared flag takes a lock in
    ``is_set()``, and a signal handler that took it too could deadlock the code it interrupted.
    """

    def __init__(self, shared: Any, parent_pid: int) -> None:
        self._shared = shared
        self._parent = parent_pid
        self.signalled = False

    def is_set(self) -> bool:
        return self.signalled or self._shared.is_set() or os.getppid() != self._parent


class _Discarded(Exception):
    """A stop was requested while ZeroMQ still delivered the last batches."""


def worker_main(
    options: ProducerOptions, index: int, stop: Any, log_level: int, parent_pid: int | None = None
) -> None:
    """Entry point of a spawned producer process; exits 0 on a clean stop.

    The pool starts it with SIGINT and SIGTERM blocked; they are unblocked once the handler is
    in place. The first signal stops the producer like the pool's flag does; a second one ends
    the process at once (the supervisor is shutting down in a hurry).
    """
    setup_logging(log_level)
    watch = _Stop(stop, parent_pid if parent_pid is not None else os.getppid())

    def on_signal(*_: object) -> None:
        if watch.signalled:
            os._exit(0)
        watch.signalled = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        sent = produce(options, index, watch)
    except ClosedError:
        return
    except _Discarded as exc:
        log.info("producer %d: %s", index, exc)
        os._exit(0)  # ZeroMQ's context is still terminating on the flush thread
    except BrokenError as exc:
        log.error("producer %d: %s", index, exc)
        raise SystemExit(3) from None
    except ConfigError as exc:  # a user source's bad batch: its message names it
        log.error("producer %d: %s", index, exc)
        raise SystemExit(2) from None
    finally:
        # Done: CPython puts the default actions back while it exits, and a late Ctrl-C would
        # then turn this exit into a death by SIGINT, which the pool would report as a failure.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    log.debug("producer %d finished after %d batches", index, sent)


def produce(options: ProducerOptions, index: int, stop: Any) -> int:
    """Send batches until ``max_batches``, the source ends, or ``stop``; return the count sent."""
    pid = producer_id(index)
    source = open_source(
        options.source, options.spec, index, options.max_unsent + 1, options.seed + index
    )
    ctx = zmq.Context(io_threads=1)
    configure = None
    if options.curve_keys:
        from stagefeed.common.curve import client_configurator

        configure = client_configurator(options.curve_keys)
    sender = BatchSender(
        ctx,
        options.connect,
        options.max_unsent,
        stop,
        configure=configure,
    )
    seq = 0
    finished = False
    interval = 1.0 / options.rate if options.rate else 0.0
    next_at = time.monotonic()
    log.info(
        "producer %s -> %s: %s %s batches of %.1f MiB, at most %d unsent",
        pid,
        options.connect,
        options.spec.image_dtype,
        options.spec.image_shape,
        options.spec.batch_bytes / 2**20,
        options.max_unsent,
    )
    try:
        for arrays in source:
            if stop.is_set():
                raise ClosedError("stop requested")
            if interval:
                delay = next_at - time.monotonic()
                while delay > 0 and not stop.is_set():
                    time.sleep(min(delay, 0.1))
                    delay = next_at - time.monotonic()
                next_at = max(next_at + interval, time.monotonic() - interval)
            sender.send(protocol.encode(pid, seq, arrays))
            seq += 1
            if options.max_batches and seq >= options.max_batches:
                break
        finished = True
    finally:
        held = sender.unsent()
        if finished:
            log.info(
                "producer %s finished: %d batches (seq 0..%d); delivering the last %d "
                "(up to %.0f s)",
                pid,
                seq,
                seq - 1,
                held,
                FLUSH_TIMEOUT_S,
            )
            sender.close(flush_s=FLUSH_TIMEOUT_S)
            _term_unless_stopped(ctx, stop, held)
        else:
            log.info(
                "producer %s stopped: %d batches handed to ZeroMQ (seq 0..%d); %d still held "
                "by ZeroMQ discarded",
                pid,
                seq,
                seq - 1,
                held,
            )
            sender.close()
            ctx.term()
    return seq


def _term_unless_stopped(ctx: zmq.Context, stop: Any, held: int) -> None:
    """``ctx.term()`` waits while ZeroMQ delivers what it holds (the linger); a stop request
    meanwhile discards the rest (``_Discarded``), as a stopped producer does."""
    flusher = threading.Thread(target=ctx.term, name="stagefeed-flush", daemon=True)
    flusher.start()
    while flusher.is_alive():
        flusher.join(POLL_S)
        if flusher.is_alive() and stop.is_set():
            raise _Discarded(
                f"stop requested while delivering the last batches: up to {held} discarded"
            )
