"""The Prometheus endpoint: the run's figures in the text exposition format over HTTP.

Metrics are collected when scraped (a custom collector reads one ``Snapshot``), so the train
loop pays nothing for them. Counters are cumulative since the trainer started, warm-up steps
included; rates and the stall ratio are the scraper's job (PromQL in docs/observability.md).

One thread, ``stagefeed-metrics-http``, answers requests one at a time; it polls a stop flag
every ``POLL_S`` and a client gets ``REQUEST_TIMEOUT_S`` to send its request, so ``close()``
returns within a few seconds whatever the clients do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from http.server import HTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler
from stagefeed.common.errors import ConfigError
from stagefeed.common.lifecycle import join_threads
from stagefeed.consumer.figures import Snapshot

if TYPE_CHECKING:
    from stagefeed.consumer.trainer import Trainer

log = logging.getLogger(__name__)

POLL_S = 0.2
REQUEST_TIMEOUT_S = 5.0
JOIN_TIMEOUT_S = REQUEST_TIMEOUT_S + 2.0
PREFIX = "stagefeed_"


class StagefeedCollector:
    """Yields the metric families of one snapshot (names in docs/observability.md)."""

    def __init__(self, snapshot: Callable[[], Snapshot], trainer: Trainer) -> None:
        self._snapshot = snapshot
        self._trainer = trainer

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        options = self._trainer.options
        spec = options.schema
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
            [
                self._trainer.device,
                spec.wire_dtype,
                str(spec.batch_size),
                str(options.queue_capacity),
            ],
            1,
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
        yield counter("trained_images", "Images trained on", steps.steps * spec.batch_size)
        yield gauge("loss", "Loss of the latest step", steps.loss)
        yield gauge("queue_batches", "Batches in the FIFOQueue", snap.queue_batches)
        yield gauge("queue_bytes", "Bytes in the FIFOQueue", snap.queue_batches * spec.batch_bytes)
        yield gauge("queue_capacity_batches", "FIFOQueue capacity", options.queue_capacity)
        yield counter(
            "queue_full_steps", "Steps that started with the FIFOQueue full", steps.full_steps
        )
        yield counter("received_bytes", "Bytes of valid batches received", snap.received_bytes)
        yield gauge("producers_seen", "Producers that delivered a valid batch", len(snap.producers))

        received = CounterMetricFamily(
            PREFIX + "received_batches", "Valid batches received", labels=["producer"]
        )
        trained = CounterMetricFamily(
            PREFIX + "trained_batches", "Batches trained on", labels=["producer"]
        )
        missing = GaugeMetricFamily(
            PREFIX + "sequence_missing_batches",
            "Sequence numbers never received between a producer's lowest and highest",
            labels=["producer"],
        )
        for name, p in sorted(snap.producers.items()):
            received.add_metric([name], p.received)
            trained.add_metric([name], p.trained)
            missing.add_metric([name], p.seq_missing)
        yield received
        yield trained
        yield missing
        dropped = CounterMetricFamily(
            PREFIX + "dropped_messages", "Messages dropped, by reason", labels=["reason"]
        )
        for reason, n in sorted(snap.dropped.items()):
            dropped.add_metric([reason], n)
        yield dropped
        connections = CounterMetricFamily(
            PREFIX + "connection_events",
            "Events of the bound socket: accepted, disconnected (oversize cuts included), "
            "handshake failures by kind",
            labels=["event"],
        )
        for event, n in sorted(self._trainer.ledger.peer_events().items()):
            connections.add_metric([event], n)
        yield connections


class _Server(HTTPServer):
    timeout = POLL_S  # handle_request() returns after this long without a request

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("metrics request from %s failed", client_address)


class MetricsServer:
    """Serves ``/metrics`` (any path, as prometheus-client does) on ``host:port``.

    ``start()`` binds or raises ``ConfigError`` naming the address; ``close()`` is idempotent.
    """

    def __init__(
        self, snapshot: Callable[[], Snapshot], trainer: Trainer, host: str, port: int
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StagefeedCollector(snapshot, trainer))
        ProcessCollector(registry=self.registry)
        self._host, self._port = host, port
        self._stop = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.address = ""

    def start(self) -> MetricsServer:
        handler = type(
            "StagefeedMetricsHandler",
            (MetricsHandler,),
            {"registry": self.registry, "timeout": REQUEST_TIMEOUT_S},
        )
        try:
            self._server = _Server((self._host, self._port), handler)
        except (OSError, OverflowError) as exc:
            raise ConfigError(f"cannot serve metrics on {self._host}:{self._port}: {exc}") from None
        host, port = self._server.server_address[:2]
        self.address = f"{host}:{port}"
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

    def close(self) -> None:
        if self._server is None or self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            join_threads([self._thread], JOIN_TIMEOUT_S)
        self._server.server_close()
