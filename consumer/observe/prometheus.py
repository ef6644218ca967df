"""The Prometheus endpoint: the run's figures in the text exposition format over HTTP.

Metrics are collected when scraped (a custom collector reads one ``Snapshot`` and the run's
``RunFacts``, nothing else), so the train loop pays nothing for them. Counters are cumulative
since the trainer started, warm-up steps included; rates and the stall ratio are the scraper's
job (PromQL in docs/observability.md).

Per-producer series (labelled with producer ids, which name hosts and pids) are exported only
with ``producer_labels``; otherwise those counters are aggregates. The server listens on
loopback unless told otherwise (``--metrics-bind``).

Clients are served concurrently: the thread ``stagefeed-metrics-http`` accepts, and each
connection gets a daemon thread ``stagefeed-metrics-client`` and at most ``CLIENT_TIMEOUT_S``
(10 s, as long as Prometheus waits for a scrape) in all, request and response: an idle or
trickling client is cut then, so one slow client never delays a scrape. At most
``MAX_CLIENTS`` connections are served at once; more are closed at once. ``close()`` cuts every
connection and returns within about a second.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import HTTPServer
from socketserver import TCPServer
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler

from stagefeed.common.errors import ConfigError
from stagefeed.common.lifecycle import join_threads
from stagefeed.consumer.memory import heap
from stagefeed.consumer.observe.figures import Snapshot
from stagefeed.consumer.run_facts import RunFacts

log = logging.getLogger(__name__)

POLL_S = 0.2
# A connection's whole time, request in and response out: Prometheus's default scrape timeout.
# Shorter cut real scrapes on a loaded host, where the client thread waits for the GIL (a
# scrape then failed under load with 2 s).
CLIENT_TIMEOUT_S = 10.0
MAX_CLIENTS = 8
JOIN_TIMEOUT_S = 1.0
PREFIX = "stagefeed_"


def labelled(name: str, doc: str, label: str, counts: Mapping[str, int]) -> Metric:
    """One counter family, a series per ``label`` value of ``counts``, in sorted order."""
    family = CounterMetricFamily(PREFIX + name, doc, labels=[label])
    for value, n in sorted(counts.items()):
        family.add_metric([value], n)
    return family


class StagefeedCollector:
    """Yields the metric families of one snapshot (names in docs/observability.md)."""

    def __init__(
        self, snapshot: Callable[[], Snapshot], facts: RunFacts, producer_labels: bool = False
    ) -> None:
        self._snapshot = snapshot
        self._facts = facts
        self._producer_labels = producer_labels

    def collect(self) -> Iterator[Metric]:
        snap, facts = self._snapshot(), self._facts
        steps = snap.steps

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        info = GaugeMetricFamily(
            PREFIX + "info",
            "Constant 1; labels describe the trainer",
            labels=["device", "wire_dtype", "batch_size", "queue_capacity"],
        )
        info.add_metric(
            [facts.device, facts.wire_dtype, str(facts.batch_size), str(facts.queue_capacity)], 1
        )
        yield info
        yield counter("steps", "Train steps run (warm-up included)", steps.steps)
        yield gauge("last_step", "Number of the latest step", steps.last_step)
        yield counter(
            "input_wait_seconds",
            "Time train steps waited for a batch before they could run (input stall)",
            steps.wait_s,
        )
        yield counter(
            "step_compute_seconds",
            "Time of the train steps themselves, waiting for input excluded",
            steps.step_s,
        )
        yield counter(
            "trained_examples", "Examples (batch rows) trained on", steps.steps * facts.batch_size
        )
        yield gauge("loss", "Loss of the latest step", steps.loss)
        yield gauge("queue_batches", "Batches in the FIFOQueue", snap.queue_batches)
        yield gauge("queue_bytes", "Bytes in the FIFOQueue", snap.queue_batches * facts.batch_bytes)
        yield gauge("queue_capacity_batches", "FIFOQueue capacity", facts.queue_capacity)
        yield counter(
            "queue_full_steps", "Steps that started with the FIFOQueue full", steps.full_steps
        )
        books = snap.books
        yield counter(
            "received_bytes", "Bytes of valid batches received", books.totals.received_bytes
        )
        yield gauge("producers_seen", "Producers that delivered a valid batch", books.delivering)
        held = heap.read()
        if held is not None:
            yield gauge("heap_in_use_bytes", "Bytes allocated by malloc, not freed", held.in_use)
            yield gauge(
                "heap_free_bytes",
                "Bytes freed and kept by malloc for reuse (resident only where once written)",
                held.free,
            )

        yield from self._per_producer(snap)
        yield labelled("dropped_messages", "Messages dropped, by reason", "reason", books.dropped)
        yield labelled(
            "connection_events",
            "Events of the bound socket: accepted, disconnected (oversize cuts included), "
            "handshake failures by kind",
            "event",
            books.peer_events,
        )
        yield labelled(
            "refused_hellos",
            "Producers refused at hello (schema mismatch, connection limit), by reason",
            "reason",
            books.refused,
        )
        yield labelled(
            "producers_ended",
            "Producer connections that said end (their bye), by reason: ok, source_error, other",
            "reason",
            books.ended,
        )

    def _per_producer(self, snap: Snapshot) -> Iterator[Metric]:
        """Per producer id with ``producer_labels``, else one series each, summed."""
        families = [
            (CounterMetricFamily, "received_batches", "Valid batches received", "received"),
            (CounterMetricFamily, "trained_batches", "Batches trained on", "trained"),
            (
                GaugeMetricFamily,
                "sequence_missing_batches",
                "Sequence numbers never received between a producer's lowest and highest",
                "seq_missing",
            ),
        ]
        producers = sorted(snap.books.producers.items())
        for kind, name, doc, attr in families:
            if not self._producer_labels:
                yield kind(PREFIX + name, doc, value=sum(getattr(p, attr) for _, p in producers))
                continue
            family = kind(PREFIX + name, doc, labels=["producer"])
            for producer, p in producers:
                family.add_metric([producer], getattr(p, attr))
            yield family


class _Server(HTTPServer):
    """Accepts on one thread, serves each connection on its own; see the module docstring."""

    timeout = POLL_S  # handle_request() returns after this long without a connection

    def __init__(
        self, address: tuple[str, int], handler: type, ipv6: bool, client_timeout_s: float
    ) -> None:
        self.address_family = socket.AF_INET6 if ipv6 else socket.AF_INET
        self.client_timeout_s = client_timeout_s
        self._lock = threading.Lock()
        self._clients: dict[socket.socket, float] = {}  # open connection -> its deadline
        self._client_threads: set[threading.Thread] = set()
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the host up in DNS (getfqdn), which can stall the start.
        TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = len(self._clients) >= MAX_CLIENTS
            if not full:
                self._clients[request] = time.monotonic() + self.client_timeout_s
        if full:
            log.debug("metrics client %s refused: %d connections open", client_address, MAX_CLIENTS)
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name="stagefeed-metrics-client",
            daemon=True,
        )
        with self._lock:
            # A thread stays in the set until it has ended (pruned here), so ``close()`` joins
            # every one still running, also one in its last instructions.
            self._client_threads = {t for t in self._client_threads if t.is_alive()}
            self._client_threads.add(thread)
        thread.start()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - one client's failure must not end the server
            self.handle_error(request, client_address)
        finally:
            with self._lock:  # out of the table before it is closed: cut() never sees it closed
                self._clients.pop(request, None)
            self.shutdown_request(request)

    def cut(self, overdue_only: bool = True) -> None:
        """Shut down the connections past their deadline (all of them with ``False``): the
        client's thread then reads EOF or fails to write, and ends."""
        now = time.monotonic()
        with self._lock:
            for sock, deadline in self._clients.items():
                if not overdue_only or now >= deadline:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # the client is already gone

    def client_threads(self) -> list[threading.Thread]:
        """The client threads still running."""
        with self._lock:
            return [t for t in self._client_threads if t.is_alive()]

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # timed out, cut, reset: the client's problem
            log.debug("metrics client %s: %s", client_address, exc)
        else:
            log.exception("metrics request from %s failed", client_address)


class MetricsServer:
    """Serves ``/metrics`` (any path, as prometheus-client does) on ``host:port``.

    ``start()`` binds or raises ``ConfigError`` naming the address; ``close()`` is idempotent.
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        facts: RunFacts,
        host: str,
        port: int,
        producer_labels: bool = False,
        client_timeout_s: float = CLIENT_TIMEOUT_S,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StagefeedCollector(snapshot, facts, producer_labels))
        ProcessCollector(registry=self.registry)
        self._host, self._port = host.strip("[]"), port
        self._client_timeout_s = client_timeout_s
        self._stop = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.address = ""  # host:port as bound ([host]:port for IPv6)
        self.bound: tuple[str, int] = ("", 0)

    def start(self) -> MetricsServer:
        handler = type(
            "StagefeedMetricsHandler",
            (MetricsHandler,),
            {"registry": self.registry, "timeout": self._client_timeout_s},
        )
        ipv6 = ":" in self._host
        try:
            self._server = _Server((self._host, self._port), handler, ipv6, self._client_timeout_s)
        except (OSError, OverflowError) as exc:
            raise ConfigError(f"cannot serve metrics on {self._host}:{self._port}: {exc}") from None
        host, port = self._server.server_address[:2]
        self.bound = (host, port)
        self.address = f"[{host}]:{port}" if ipv6 else f"{host}:{port}"
        # Daemon only as a last resort: close() stops and joins it; if a join ever times out
        # (logged), the process can still exit.
        self._thread = threading.Thread(
            target=self._serve, name="stagefeed-metrics-http", daemon=True
        )
        self._thread.start()
        log.info("Prometheus metrics on http://%s/metrics", self.address)
        return self

    def _serve(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            self._server.handle_request()
            self._server.cut()

    def close(self) -> None:
        if self._server is None or self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            join_threads([self._thread], JOIN_TIMEOUT_S)
        self._server.cut(overdue_only=False)
        join_threads(self._server.client_threads(), JOIN_TIMEOUT_S)
        self._server.server_close()
