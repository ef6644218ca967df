"""The Prometheus endpoint: scraped over HTTP while a real trainer trains, and in-process."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stagefeed.cli import build_parser
from stagefeed.common.errors import ConfigError, DropReason
from stagefeed.common.options import ObserveOptions
from stagefeed.common.schema import image_schema
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.observe.figures import StepCounters, take_snapshot
from stagefeed.consumer.observe.prometheus import CLIENT_TIMEOUT_S, MAX_CLIENTS, MetricsServer
from stagefeed.consumer.run_facts import RunFacts, RunReader, StepRecord
from tests.conftest import TINY, cli_env, free_tcp_port, run_cli, wait_for

SPEC = image_schema(batch_size=2)
FACTS = RunFacts("/gpu:0", 2, SPEC.batch_bytes, "float32", queue_capacity=20)


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` parsed by prometheus-client's own parser."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def try_scrape(address: str) -> dict | None:
    try:
        return scrape(address)
    except OSError:  # not listening yet
        return None


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics[(name, tuple(sorted(labels.items())))]


@pytest.mark.slow
def test_endpoint_moves_while_a_real_trainer_trains(start_cli, tmp_path) -> None:
    port, metrics_port = free_tcp_port(), free_tcp_port()
    address = f"127.0.0.1:{metrics_port}"
    summary_path = tmp_path / "summary.json"
    # The settings come from the environment: STAGEFEED_METRICS_PORT works like --metrics-port.
    env = cli_env(
        STAGEFEED_METRICS_PORT=str(metrics_port),
        STAGEFEED_METRICS_BIND="127.0.0.1",
        STAGEFEED_METRICS_PRODUCER_LABELS="1",
    )
    trainer = start_cli(
        ["train", "--bind", f"tcp://127.0.0.1:{port}", *TINY, "--steps", "0",
         "--queue-mb", "24", "--json", str(summary_path)],
        name="train",
        env=env,
    )  # fmt: skip
    producer = start_cli(
        ["produce", "--connect", f"tcp://127.0.0.1:{port}", *TINY, "--inflight-mb", "16"],
        name="produce",
    )
    seen: dict = {}

    def stepped(at_least: float) -> bool:
        metrics = try_scrape(address)
        if metrics and value(metrics, "stagefeed_steps_total") >= at_least:
            seen.update(metrics)
            return True
        return False

    assert wait_for(lambda: stepped(2), timeout=90), trainer.output()[-3000:]
    first = dict(seen)
    steps = value(first, "stagefeed_steps_total")
    assert wait_for(lambda: stepped(steps + 2), timeout=60), trainer.output()[-3000:]
    second = dict(seen)

    assert value(first, "stagefeed_info", device="/cpu:0", wire_dtype="float32",
                 batch_size="2", queue_capacity="20") == 1  # fmt: skip
    assert value(first, "stagefeed_queue_capacity_batches") == 20
    assert 0 <= value(second, "stagefeed_queue_batches") <= 20
    assert value(second, "stagefeed_producers_seen") == 1
    producers = [labels for (name, labels) in second if name == "stagefeed_received_batches_total"]
    assert len(producers) == 1
    who = dict(producers[0])["producer"]
    for name in ("stagefeed_steps_total", "stagefeed_trained_examples_total",
                 "stagefeed_received_bytes_total", "process_cpu_seconds_total"):  # fmt: skip
        assert value(second, name) > value(first, name), name
    assert value(second, "stagefeed_trained_examples_total") == 2 * value(
        second, "stagefeed_steps_total"
    )
    assert value(second, "stagefeed_step_compute_seconds_total") > value(
        first, "stagefeed_step_compute_seconds_total"
    )
    assert value(second, "stagefeed_input_wait_seconds_total") >= 0
    received = value(second, "stagefeed_received_batches_total", producer=who)
    trained = value(second, "stagefeed_trained_batches_total", producer=who)
    assert received >= trained >= value(first, "stagefeed_trained_batches_total", producer=who)
    assert trained > 0
    assert value(second, "stagefeed_sequence_missing_batches", producer=who) >= 0
    assert value(second, "stagefeed_connection_events_total", event="accepted") >= 1

    trainer.signal(signal.SIGTERM)
    assert trainer.wait(30) == 0, trainer.output()[-3000:]
    with pytest.raises(OSError):  # the server thread is gone and the port closed
        socket.create_connection(("127.0.0.1", metrics_port), timeout=2).close()
    summary = json.loads(summary_path.read_text())
    assert summary["advice"].startswith(summary["bottleneck"] + ": ")
    assert f"Prometheus metrics on http://{address}/metrics" in trainer.output()
    producer.signal(signal.SIGTERM)
    assert producer.wait(30) == 0


# The cut tests' client limit: shorter than the default, so they take a second, not ten.
CLIENT_S = 1.0
IDLE_CLIENT_S = 4.0


def _served(
    port: int = 0, producer_labels: bool = False, host: str = "127.0.0.1",
    client_s: float = CLIENT_S,
) -> tuple[MetricsServer, Ledger, StepCounters]:  # fmt: skip
    """A server reading a real ledger and counters, the queue 3 batches full."""
    ledger, counters = Ledger(), StepCounters(FACTS.queue_capacity)
    reader = RunReader(queue_batches=lambda: 3, books=ledger.read)
    server = MetricsServer(
        lambda: take_snapshot(counters, reader), FACTS, host, port, producer_labels, client_s
    )
    return server.start(), ledger, counters


def _books(ledger: Ledger, counters: StepCounters) -> None:
    """Two producers: prod-a delivers seq 0 and 2 (1 missing) and a duplicate, then ends ok;
    prod-b one, then ends with a source error; prod-c only says hello. One message without a
    connection, two connection events and a refused hello."""
    a, b = ledger.open("prod-a"), ledger.open("prod-b")
    ledger.open("prod-c")
    ledger.accept(a, 0, SPEC.batch_bytes)
    ledger.accept(a, 2, SPEC.batch_bytes)
    ledger.trained([a], [0])
    ledger.accept(a, 2, SPEC.batch_bytes)  # duplicate
    ledger.accept(b, 0, SPEC.batch_bytes)
    ledger.drop(DropReason.NO_HELLO, "junk")
    ledger.peer_event("accepted")
    ledger.peer_event("accepted")
    ledger.refused("prod-x", "spec_mismatch", "images: ...")
    ledger.ended(a, 3)
    ledger.ended(b, 1, "source_error", "source 'm:f' batch 1: ...")
    counters.add(StepRecord(1, True, 0.25, 0.5, 3.5, 0, 0.0))


def test_scrape_reports_the_books_and_close_joins_the_threads() -> None:
    server, ledger, counters = _served(producer_labels=True)
    try:
        _books(ledger, counters)
        metrics = scrape(server.address)
    finally:
        server.close()
    assert value(metrics, "stagefeed_info", device="/gpu:0", wire_dtype="float32",
                 batch_size="2", queue_capacity="20") == 1  # fmt: skip
    assert value(metrics, "stagefeed_queue_batches") == 3
    assert value(metrics, "stagefeed_queue_bytes") == 3 * SPEC.batch_bytes
    assert value(metrics, "stagefeed_queue_capacity_batches") == 20
    assert value(metrics, "stagefeed_trained_examples_total") == 2
    assert value(metrics, "stagefeed_producers_seen") == 2  # prod-c delivered nothing
    assert value(metrics, "stagefeed_dropped_messages_total", reason="no_hello") == 1
    assert value(metrics, "stagefeed_connection_events_total", event="accepted") == 2
    assert value(metrics, "stagefeed_refused_hellos_total", reason="spec_mismatch") == 1
    assert value(metrics, "stagefeed_producers_ended_total", reason="ok") == 1
    assert value(metrics, "stagefeed_producers_ended_total", reason="source_error") == 1
    assert value(metrics, "stagefeed_steps_total") == 1
    assert value(metrics, "stagefeed_input_wait_seconds_total") == 0.25
    assert value(metrics, "stagefeed_step_compute_seconds_total") == 0.5
    assert value(metrics, "stagefeed_loss") == 3.5
    assert value(metrics, "stagefeed_received_batches_total", producer="prod-a") == 2
    assert value(metrics, "stagefeed_trained_batches_total", producer="prod-a") == 1
    assert value(metrics, "stagefeed_sequence_missing_batches", producer="prod-a") == 1
    assert value(metrics, "stagefeed_received_batches_total", producer="prod-b") == 1
    assert value(metrics, "stagefeed_dropped_messages_total", reason="duplicate") == 1
    assert value(metrics, "stagefeed_received_bytes_total") == 3 * SPEC.batch_bytes
    # This process's malloc figures: it has imported TensorFlow, tens of MiB in use.
    assert value(metrics, "stagefeed_heap_in_use_bytes") > 16 * 2**20
    assert value(metrics, "stagefeed_heap_free_bytes") >= 0
    assert not [t for t in threading.enumerate() if t.name.startswith("stagefeed-metrics")]
    server.close()  # idempotent


def test_producer_ids_are_absent_by_default_and_the_counters_aggregate() -> None:
    server, ledger, counters = _served()
    try:
        _books(ledger, counters)
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as response:
            text = response.read().decode()
        metrics = scrape(server.address)
    finally:
        server.close()
    assert "prod-a" not in text and "prod-b" not in text and 'producer="' not in text
    assert value(metrics, "stagefeed_received_batches_total") == 3
    assert value(metrics, "stagefeed_trained_batches_total") == 1
    assert value(metrics, "stagefeed_sequence_missing_batches") == 1
    assert value(metrics, "stagefeed_producers_seen") == 2


def test_the_default_bind_is_loopback() -> None:
    assert ObserveOptions().metrics_bind == "127.0.0.1"
    args = build_parser().parse_args(["train", "--metrics-port", "0"])
    assert args.metrics_bind == "127.0.0.1" and not args.metrics_producer_labels
    server, _, _ = _served(host=args.metrics_bind)
    try:
        assert server.bound[0] == "127.0.0.1"
        assert server.address == f"127.0.0.1:{server.bound[1]}"
    finally:
        server.close()


def _idle(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_by_peer(sock: socket.socket) -> bool:
    """True if the server closed the connection (EOF or reset); False while it is open."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    finally:
        sock.setblocking(True)


def test_idle_connections_do_not_delay_a_scrape_and_are_cut_after_the_client_limit() -> None:
    # A limit no scrape comes near, even on a loaded machine: the idle clients are surely
    # still held when it is answered.
    server, ledger, counters = _served(client_s=IDLE_CLIENT_S)
    try:
        _books(ledger, counters)
        idle = [_idle(server.address) for _ in range(2)]
        opened = time.monotonic()
        metrics = scrape(server.address)
        # Both idle clients still hold their connections: the scrape was answered while they
        # waited, not after the server gave up on them.
        still_open = [not _closed_by_peer(s) for s in idle]
        answered_within = time.monotonic() - opened
        assert value(metrics, "stagefeed_steps_total") == 1
        assert all(still_open), f"an idle client was cut before the scrape ({answered_within} s)"
        # Then each is cut once its time is up.
        assert wait_for(lambda: all(_closed_by_peer(s) for s in idle), 10), (
            "idle connections not cut within 10 s"
        )
        for s in idle:
            s.close()
    finally:
        server.close()


def test_a_trickling_client_is_cut_at_the_client_limit_not_per_byte() -> None:
    server, _, _ = _served()
    try:
        sock = _idle(server.address)
        request = b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"x" * 200
        began = time.monotonic()
        cut = False
        for byte in request:  # one byte every 0.1 s: each read succeeds, the whole takes 20 s
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                cut = True
                break
            if _closed_by_peer(sock):
                cut = True
                break
            time.sleep(0.1)
        took = time.monotonic() - began
        sock.close()
        assert cut, "the server waited for the whole trickle"
        assert took < 10 * CLIENT_S  # cut long before the 20 s trickle ended
    finally:
        server.close()


def test_connections_beyond_the_limit_are_refused_and_close_cuts_the_rest() -> None:
    server, _, _ = _served(client_s=CLIENT_TIMEOUT_S)  # all held while the ninth comes
    try:
        held = [_idle(server.address) for _ in range(MAX_CLIENTS)]
        assert wait_for(lambda: len(server._server.client_threads()) == MAX_CLIENTS, 10), (
            f"{len(server._server.client_threads())} of {MAX_CLIENTS} clients served after 10 s"
        )
        extra = _idle(server.address)
        assert wait_for(lambda: _closed_by_peer(extra), 10), "the ninth not refused in 10 s"
        extra.close()
    finally:
        server.close()
    assert all(wait_for(lambda s=s: _closed_by_peer(s), 5) for s in held), (
        "close() did not cut every held connection (5 s each)"
    )
    for s in held:
        s.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("stagefeed-metrics")]


def test_a_busy_port_fails_at_start_naming_the_address() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            _served(port)


def test_bad_port_values_fail_at_start() -> None:
    proc = run_cli(["run", *TINY, "--metrics-port", "70000"], timeout=60)
    assert proc.returncode == 2
    assert "metrics_port must be an integer in [0, 65535], got 70000" in proc.stderr
    proc = run_cli(["train", *TINY], timeout=60, env=cli_env(STAGEFEED_METRICS_PORT="http"))
    assert proc.returncode == 2
    assert "STAGEFEED_METRICS_PORT='http'" in proc.stderr
