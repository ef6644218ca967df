"""The Prometheus endpoint: scraped over HTTP while a real trainer trains, and in-process."""

from __future__ import annotations

import json
import signal
import socket
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import image_schema
from stagefeed.consumer.figures import StepCounters, take_snapshot
from stagefeed.consumer.metrics_http import MetricsServer
from stagefeed.consumer.trainer import StepRecord, Trainer

from tests.conftest import TINY, cli_env, free_tcp_port, run_cli, wait_for

SPEC = image_schema(batch_size=2)


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
    # The port comes from the environment: STAGEFEED_METRICS_PORT works like --metrics-port.
    env = cli_env(STAGEFEED_METRICS_PORT=str(metrics_port), STAGEFEED_METRICS_HOST="127.0.0.1")
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
    for name in ("stagefeed_steps_total", "stagefeed_trained_images_total",
                 "stagefeed_received_bytes_total", "process_cpu_seconds_total"):  # fmt: skip
        assert value(second, name) > value(first, name), name
    assert value(second, "stagefeed_trained_images_total") == 2 * value(
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


def _served(port: int = 0) -> tuple[MetricsServer, Trainer, StepCounters]:
    trainer = Trainer(TrainerOptions(bind="tcp://127.0.0.1:*", schema=SPEC, queue_mb=24))
    counters = StepCounters(trainer.options.queue_capacity)
    server = MetricsServer(lambda: take_snapshot(counters, trainer), trainer, "127.0.0.1", port)
    return server.start(), trainer, counters


def test_scrape_reports_the_books_and_close_joins_the_thread() -> None:
    server, trainer, counters = _served()
    try:
        index = trainer.ledger.open("prod-a")
        trainer.ledger.accept(index, 0, SPEC.batch_bytes)
        trainer.ledger.accept(index, 2, SPEC.batch_bytes)  # seq 1 missing
        trainer.ledger.trained([index], [0])
        trainer.ledger.accept(index, 2, SPEC.batch_bytes)  # duplicate
        counters.add(StepRecord(1, True, 0.25, 0.5, 3.5, 0, 0.0))
        metrics = scrape(server.address)
    finally:
        server.close()
    assert value(metrics, "stagefeed_steps_total") == 1
    assert value(metrics, "stagefeed_input_wait_seconds_total") == 0.25
    assert value(metrics, "stagefeed_step_compute_seconds_total") == 0.5
    assert value(metrics, "stagefeed_loss") == 3.5
    assert value(metrics, "stagefeed_received_batches_total", producer="prod-a") == 2
    assert value(metrics, "stagefeed_trained_batches_total", producer="prod-a") == 1
    assert value(metrics, "stagefeed_sequence_missing_batches", producer="prod-a") == 1
    assert value(metrics, "stagefeed_dropped_messages_total", reason="duplicate") == 1
    assert value(metrics, "stagefeed_received_bytes_total") == 2 * SPEC.batch_bytes
    assert not any(t.name == "stagefeed-metrics-http" for t in threading.enumerate())
    server.close()  # idempotent


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
    assert "metrics_port must be in [0, 65535], got 70000" in proc.stderr
    proc = run_cli(["train", *TINY], timeout=60, env=cli_env(STAGEFEED_METRICS_PORT="http"))
    assert proc.returncode == 2
    assert "STAGEFEED_METRICS_PORT='http'" in proc.stderr
