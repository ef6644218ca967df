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
from stagefeed.common.errors import BrokenError, ClosedError
from stagefeed.common.logs import setup_logging
from stagefeed.common.options import ProducerOptions
from stagefeed.producer.sender import BatchSender
from stagefeed.producer.sources import open_source

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 30.0
_flushing = threading.Event()


def producer_id(index: int) -> str:
    """Unique per process run: host, pid, worker index and a nonce (no reuse after restart)."""
    host = "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())[:32]
    return f"{host}-{os.getpid()}-{index}-{secrets.token_hex(2)}"


class _ParentWatch:
    """Stop flag that is also set when the parent process dies (no orphans left running)."""

    def __init__(self, stop: Any) -> None:
        self._stop = stop
        self._parent = os.getppid()

    def is_set(self) -> bool:
        return self._stop.is_set() or os.getppid() != self._parent


def worker_main(options: ProducerOptions, index: int, stop: Any, log_level: int) -> None:
    """Entry point of a spawned producer process; exits 0 on a clean stop."""
    setup_logging(log_level)

    def on_signal(*_: object) -> None:
        # The supervisor owns shutdown: a signal sets the stop flag. While the last batches
        # are being delivered (ZeroMQ linger inside ``Context.term``), stopping means
        # discarding them: exit at once.
        if _flushing.is_set():
            os._exit(0)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        sent = produce(options, index, _ParentWatch(stop))
    except ClosedError:
        return
    except BrokenError as exc:
        log.error("producer %d: %s", index, exc)
        raise SystemExit(3) from None
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
            _flushing.set()
            sender.close(flush_s=FLUSH_TIMEOUT_S)
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
        ctx.term()  # waits for the linger of a finished producer
    return seq
