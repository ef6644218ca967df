"""Real trainer and producer processes over loopback: every batch sent is accounted for."""

from __future__ import annotations

import json
import math
import re

import zmq

from stagefeed.common import protocol
from tests.conftest import TINY, free_tcp_port
from tests.helpers import procs

pytestmark = __import__("pytest").mark.slow


def _summary(path) -> dict:
    with open(path) as f:
        return json.load(f)


def _handed(output: str) -> dict[str, int]:
    """Batches each producer that finished cleanly sent, from its exit log line."""
    return {pid: int(n) for pid, n in re.findall(r"producer (\S+) finished: (\d+) batches", output)}


def _start_producers(start_cli, port: int, max_batches: int):
    """Two producer processes that each send ``max_batches`` batches, then finish cleanly."""
    return start_cli(
        ["produce", "--connect", f"tcp://127.0.0.1:{port}", "--workers", "2", *TINY,
         "--max-batches", str(max_batches)],
        name="producers",
    )  # fmt: skip


def _endless_trainer(start_cli, port: int, summary_path):
    """A ``--steps 0`` trainer of TINY batches writing its summary to ``summary_path``."""
    return start_cli(
        ["train", "--bind", f"tcp://127.0.0.1:{port}", *TINY, "--steps", "0",
         "--json", str(summary_path)],
        name="trainer",
    )  # fmt: skip


def test_every_batch_sent_is_trained_or_queued(tmp_path, start_cli):
    """2 producers x 8 batches; the trainer needs all 16 (2 warm-up + 12 timed + 2 staged)."""
    port = free_tcp_port()
    summary_path = tmp_path / "summary.json"
    trainer = start_cli(
        [
            "train",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            *TINY,
            "--steps",
            "12",
            "--json",
            str(summary_path),
        ],
        name="trainer",
    )
    producers = _start_producers(start_cli, port, max_batches=8)
    assert producers.wait(120) == 0, producers.output()
    assert trainer.wait(120) == 0, trainer.output()
    summary = _summary(summary_path)
    sent = _handed(producers.output())
    assert len(sent) == 2 and all(n == 8 for n in sent.values()), producers.output()

    assert set(summary["producers"]) == set(sent)
    for pid, stats in summary["producers"].items():
        assert stats["received"] == sent[pid]
        assert stats["received"] == stats["trained"] + stats["queued_at_stop"]
        assert stats["not_enqueued"] == 0
        assert stats["dropped"] == {}
        assert stats["seq_first"] == 0 and stats["seq_last"] == 7
        assert stats["seq_missing"] == 0 and stats["seq_duplicates"] == 0
        assert stats["trained_duplicates"] == 0
    batches = summary["batches"]
    assert batches == {
        "received": 16,
        "trained": 14,
        "queued_at_stop": 2,
        "abandoned": 0,
        "not_enqueued": 0,
        "dropped": 0,
        "seq_missing": 0,
    }
    assert summary["steps"] == 12 and summary["warmup_steps"] == 2
    # The seed's AlexNet (dense kernels of stddev 1.0, SGD 0.01) diverges on batches of 2
    # random images after a few steps: only the first loss is asked to be finite here.
    assert summary["loss_first"] is not None and math.isfinite(summary["loss_first"])
    assert summary["median_ms"] > 0 and summary["examples_per_s"] > 0


def test_trainer_stopped_by_signal_accounts_for_what_it_holds(tmp_path, start_cli):
    """Producers finish first; SIGTERM then stops a --steps 0 trainer with batches queued."""
    import signal

    from tests.conftest import wait_for

    port, metrics_port = free_tcp_port(), free_tcp_port()
    summary_path = tmp_path / "summary.json"
    trainer = start_cli(
        [
            "train",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            "--metrics-port",
            str(metrics_port),
            *TINY,
            "--steps",
            "0",
            "--warmup-steps",
            "0",
            "--json",
            str(summary_path),
            "--progress-s",
            "0.2",
        ],
        name="trainer",
    )
    producers = _start_producers(start_cli, port, max_batches=30)
    assert producers.wait(120) == 0, producers.output()
    assert wait_for(lambda: "step " in trainer.output(), 60), trainer.output()

    def received() -> float:  # a producer's last batch may still be in the trainer's socket
        return procs.Metrics.scrape(metrics_port).samples.get(
            ("stagefeed_received_batches_total", ()), 0
        )

    assert wait_for(lambda: received() == 60, 30), received()
    trainer.signal(signal.SIGTERM)
    assert trainer.wait(20) == 0, trainer.output()
    summary = _summary(summary_path)
    assert summary["interrupted"] is True
    batches = summary["batches"]
    assert batches["received"] == 60
    assert batches["trained"] + batches["queued_at_stop"] + batches["not_enqueued"] == 60
    assert batches["trained"] >= 1 and batches["queued_at_stop"] >= 2  # staging stays filled
    assert batches["dropped"] == 0 and batches["seq_missing"] == 0


def test_finite_producers_are_trained_to_the_last_batch_and_the_trainer_stops(tmp_path, start_cli):
    """``--steps 0`` with producers that end: every batch is trained (no lost tail: the queued
    and staged ones too), then the trainer stops by itself with exit code 0."""
    port, summary_path = free_tcp_port(), tmp_path / "summary.json"
    trainer = _endless_trainer(start_cli, port, summary_path)
    producers = _start_producers(start_cli, port, max_batches=12)
    assert producers.wait(120) == 0, producers.output()
    assert trainer.wait(120) == 0, trainer.output()
    summary = _summary(summary_path)
    assert summary["data_ended"] and not summary["interrupted"]
    assert summary["batches"]["received"] == 24
    assert summary["batches"]["trained"] == 24 and summary["batches"]["queued_at_stop"] == 0
    for stats in summary["producers"].values():
        assert stats["ended_after"] == 12 and stats["trained"] == 12
    assert "every producer's data ended" in trainer.output()


def test_an_end_from_a_peer_that_delivered_nothing_does_not_end_the_data(tmp_path, start_cli):
    """``hello`` then ``end {seq: 0}`` from a peer that never sent a batch, to a ``--steps 0``
    trainer no producer has reached yet: the data has not ended (before, the trainer stopped
    at once with 0 steps). Producers that deliver and end then end it, every batch trained."""
    port, summary_path = free_tcp_port(), tmp_path / "summary.json"
    trainer = _endless_trainer(start_cli, port, summary_path)
    assert procs.wait_log(trainer, r"listening on tcp://", 90), trainer.output()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(protocol.encode_control("hello", name="ends-at-once", schema=None))
        assert sock.poll(30_000), "no welcome"
        assert protocol.decode_header(sock.recv(), protocol.FROM_TRAINER)["t"] == "welcome"
        sock.send(protocol.encode_control("end", seq=0))
        assert procs.wait_log(trainer, r"ends-at-once: end of data after 0 batches", 30)
        producers = _start_producers(start_cli, port, max_batches=3)
        assert trainer.wait(120) == 0, trainer.output()
        summary = _summary(summary_path)
        assert summary["data_ended"] and not summary["interrupted"]
        assert summary["batches"]["trained"] == 6, summary["batches"]
        assert producers.wait(60) == 0, producers.output()
    finally:
        ctx.destroy(linger=0)


def test_a_source_failing_at_batch_3_has_its_good_batches_trained_and_its_reason_booked(
    tmp_path, start_cli
):
    """A producer whose labels go out of bounds at batch 3: batches 0..2 are delivered and
    trained, the trainer's log, text summary, JSON and metrics say why the producer left, and
    ``stagefeed produce`` still exits 2 with the error in one line."""
    port, summary_path = free_tcp_port(), tmp_path / "summary.json"
    trainer = _endless_trainer(start_cli, port, summary_path)
    source = "tests.helpers.user_source:labels_out_of_bounds_at_3"
    producer = start_cli(
        ["produce", "--connect", f"tcp://127.0.0.1:{port}", *TINY, "--source", source],
        name="producer",
    )
    assert producer.wait(120) == 2, producer.output()
    errors = [line for line in producer.output().splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"stagefeed: error: source '{source}'")
    reason = errors[0].removeprefix("stagefeed: error: ")
    assert reason.startswith(f"source '{source}' batch 3: "), reason
    assert "labels" in reason, reason
    assert trainer.wait(120) == 0, trainer.output()  # its data ended: the producer said end
    output, summary = trainer.output(), _summary(summary_path)
    [(name, stats)] = summary["producers"].items()
    assert (stats["received"], stats["trained"], stats["ended_after"]) == (3, 3, 3)
    assert (stats["end_reason"], stats["end_detail"]) == ("source_error", reason)
    assert summary["producers_ended"] == {"source_error": 1}
    assert summary["producers_left"] == [
        {"producer": name, "reason": "source_error", "detail": reason, "ended_after": 3}
    ]
    assert f"producer {name}: end of data after 3 batches (source_error: {reason})" in output
    assert f"producer {name} left after 3 batches: source_error: {reason}" in output
    assert f"{name}: received 3, trained 3" in output and ", ended source_error" in output
