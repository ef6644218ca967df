"""The receive pool: one bound PULL socket, a proxy, and K threads that decode and enqueue."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf
import zmq
from stagefeed.common import protocol
from stagefeed.common.errors import BrokenError, ConfigError, ProtocolError
from stagefeed.common.ipc_file import IpcFile
from stagefeed.common.ledger import Ledger
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.options import TrainerOptions
from stagefeed.consumer.graph import FeedGraph
from stagefeed.consumer.peers import PeerMonitor

log = logging.getLogger(__name__)

POLL_MS = 100
JOIN_TIMEOUT_S = 3.0


class Availability:
    """Batches made available in the FIFOQueue, counted after each enqueue returns.

    Invariant: ``enqueued - consumed`` (the train loop's count of dequeues) is a lower bound on
    the queue's size, so a dequeue issued when it is positive never blocks.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.enqueued = 0

    def add(self) -> None:
        with self._cond:
            self.enqueued += 1
            self._cond.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        """True once at least ``count`` batches were enqueued in total."""
        with self._cond:
            return self._cond.wait_for(lambda: self.enqueued >= count, timeout_s)


class ReceivePool:
    """Frontend PULL socket bound on ``options.bind`` -> proxy -> K receive threads.

    Each thread owns its own PULL socket (no ZeroMQ socket is shared between threads). High-water
    marks of 1 and ``MAXMSGSIZE`` bound what ZeroMQ holds; a thread blocked in a full FIFOQueue's
    enqueue stops taking messages, and the backpressure reaches the producers' PUSH sockets.
    """

    def __init__(
        self,
        options: TrainerOptions,
        feed: FeedGraph,
        session: Any,
        ledger: Ledger,
        availability: Availability,
        configure_server: Callable[[zmq.Socket], None] | None = None,
    ) -> None:
        self.options = options
        self._feed = feed
        self._session = session
        self._ledger = ledger
        self._availability = availability
        self._configure_server = configure_server
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ctx: zmq.Context | None = None
        self.endpoint = ""
        self.failure: BaseException | None = None
        self._closed = False
        self._ipc_file: IpcFile | None = None

    def start(self) -> ReceivePool:
        """Bind and start the threads; raise ``ConfigError`` if the address cannot be bound."""
        self._ctx = zmq.Context(io_threads=min(4, self.options.recv_threads))
        backend_addr = f"inproc://recv-{id(self)}"
        frontend = self._ctx.socket(zmq.PULL)
        frontend.setsockopt(zmq.RCVHWM, 1)
        frontend.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
        frontend.setsockopt(zmq.LINGER, 0)
        if self._configure_server is not None:
            self._configure_server(frontend)
        peers = PeerMonitor(frontend, self._ledger, self._stop, self._fail)
        try:
            frontend.bind(self.options.bind)
        except zmq.ZMQError as exc:
            frontend.close(linger=0)
            peers.abandon()
            self._close_configurator()
            self._ctx.term()
            raise ConfigError(f"cannot bind {self.options.bind!r}: {exc}") from None
        self.endpoint = frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_file = IpcFile(self.endpoint)
        backend = self._ctx.socket(zmq.PUSH)
        backend.setsockopt(zmq.SNDHWM, 1)
        backend.setsockopt(zmq.LINGER, 0)
        backend.bind(backend_addr)
        proxy = threading.Thread(
            target=self._proxy, args=(frontend, backend), name="stagefeed-proxy"
        )
        self._threads.append(proxy)
        self._threads.append(peers.thread)
        for i in range(self.options.recv_threads):
            self._threads.append(
                threading.Thread(
                    target=self._receive, args=(backend_addr,), name=f"stagefeed-recv-{i}"
                )
            )
        for thread in self._threads:
            thread.start()
        log.info(
            "listening on %s with %d receive threads (max message %.1f MiB)",
            self.endpoint,
            self.options.recv_threads,
            self.options.max_message_bytes / 2**20,
        )
        return self

    def close(self) -> None:
        """Idempotent. Call after the FIFOQueue was closed, so no enqueue blocks."""
        if self._closed or self._ctx is None:
            return
        self._closed = True
        self._stop.set()
        stuck = join_threads(self._threads, JOIN_TIMEOUT_S)
        stuck += self._close_configurator()
        if stuck:
            self._ctx.destroy(linger=0)
        else:
            self._ctx.term()
        if self._ipc_file is not None:
            self._ipc_file.remove()

    def _close_configurator(self) -> list[str]:
        """Stop what the socket configurator runs (CURVE's authenticator): before ``term``."""
        close = getattr(self._configure_server, "close", None)
        return close() if close is not None else []

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc

    def check(self) -> None:
        """Raise ``BrokenError`` if a receive thread died."""
        if self.failure is not None:
            raise BrokenError(f"receive thread failed: {self.failure!r}") from self.failure

    def _proxy(self, frontend: zmq.Socket, backend: zmq.Socket) -> None:
        # A Python loop rather than zmq.proxy: libzmq's proxy blocks in a send to a full backend
        # and would never see a stop request. Frames are passed on without copying.
        try:
            while not self._stop.is_set():
                if not frontend.poll(POLL_MS):
                    continue
                frames = frontend.recv_multipart(copy=False)
                while not self._stop.is_set():
                    if self._pass_on(backend, frames):
                        break
        except Exception as exc:  # noqa: BLE001 - reported to the train loop, never swallowed
            log.exception("proxy thread failed")
            self.failure = exc
        finally:
            frontend.close(linger=0)
            backend.close(linger=0)

    @staticmethod
    def _pass_on(backend: zmq.Socket, frames: list[zmq.Frame]) -> bool:
        # Never a blocking send: a receive thread that closes its socket at shutdown can leave
        # POLLOUT true for a pipe that is going away, and a blocking send would then never return.
        if not backend.poll(POLL_MS, zmq.POLLOUT):
            return False
        try:
            backend.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def _receive(self, backend_addr: str) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(backend_addr)
        try:
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    self._handle(sock.recv_multipart(copy=False))
        except Exception as exc:  # noqa: BLE001 - reported to the train loop, never swallowed
            if not self._stop.is_set():
                log.exception("receive thread %s failed", threading.current_thread().name)
                self.failure = exc
        finally:
            sock.close(linger=0)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        batch = None
        try:
            batch = protocol.decode(frames)
            protocol.check_against_spec(batch, self.options.spec)
        except ProtocolError as exc:
            self._ledger.drop(exc.reason, exc.detail, producer=batch.producer if batch else None)
            return
        index = self._ledger.accept(batch.producer, batch.seq, batch.nbytes)
        if index is None:
            return
        feed = self._feed
        try:
            self._session.run(
                feed.enqueue,
                {
                    feed.images_in: batch.arrays["images"],
                    feed.labels_in: batch.arrays["labels"],
                    feed.producer_in: index,
                    feed.seq_in: batch.seq,
                },
            )
        except (tf.errors.CancelledError, tf.errors.OutOfRangeError):
            return  # the queue was closed for shutdown: the batch stays "not enqueued"
        self._ledger.enqueued(index)
        self._availability.add()
