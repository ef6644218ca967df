"""Faults against real processes: producers that join, die or lose their connection, a trainer
killed and restarted under running producers, and a trainer slower than its producers.

Live counters come from the trainer's Prometheus endpoint; producer ids carry the worker's pid
(``host-PID-INDEX-NONCE``), which is how a test finds the counters of the process it started.
"""

from __future__ import annotations

import os
import re
import signal

import msgpack
import numpy as np
import pytest
import zmq
import zmq.utils.monitor

from tests.conftest import TINY
from tests.helpers import procs
from tests.helpers.peer import Peer

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

WAIT_S = 90
BASE_RATE = "4"
CREDIT_PER_PRODUCER = 2  # TrainerOptions.credit_per_producer
INFLIGHT_MB = 8  # producer budget under test: max(1, 8 MiB // 1.18 MiB) = 6 unsent batches


def _produce(spawn: procs.Spawner, endpoint: str, *extra: str, name: str):
    started = spawn(["produce", "--connect", endpoint, *TINY, *extra], name=name)
    (worker,) = procs.workers_of(started, 1)
    return started, worker


def _id_of(trainer: procs.Trainer, worker_pid: int) -> str:
    """The producer id of ``worker_pid`` once the trainer has trained one of its batches."""
    live = trainer.wait_metrics(lambda m: procs.producer_ids_of(worker_pid, m.trained), WAIT_S)
    ids = procs.producer_ids_of(worker_pid, live.trained)
    assert len(ids) == 1, f"trained batches of worker {worker_pid} in {WAIT_S} s: {ids}"
    return ids[0]


class Busy:
    """A trainer training on a rate-limited base producer; tests add producers to it."""

    def __init__(self, spawn: procs.Spawner) -> None:
        self.spawn = spawn
        self.trainer = procs.Trainer(spawn)
        _, worker = _produce(spawn, self.trainer.endpoint, "--rate", BASE_RATE, name="base")
        self.base = _id_of(self.trainer, worker.pid)
        # TensorFlow's working memory is allocated by the first steps: measure after them,
        # while the queue is near empty (the base producer is slower than the trainer).
        warm = self.trainer.wait_metrics(lambda m: m.trained.get(self.base, 0) >= 6, WAIT_S)
        assert warm.trained.get(self.base, 0) >= 6, f"6 batches not trained in {WAIT_S} s"

    def trained_more(self, producer: str, since: procs.Metrics, more: int) -> procs.Metrics:
        was = since.trained.get(producer, 0)
        live = self.trainer.wait_metrics(lambda m: m.trained.get(producer, 0) >= was + more, WAIT_S)
        assert live.trained.get(producer, 0) >= was + more, f"{producer} is not being trained"
        return live


@pytest.fixture(scope="module")
def busy(tmp_path_factory):
    spawn = procs.Spawner(tmp_path_factory.mktemp("faults"))
    try:
        yield Busy(spawn)
    finally:
        spawn.kill_all()


def test_producer_joining_a_running_trainer_is_used_at_once(busy):
    before = busy.trainer.metrics()
    started, worker = _produce(busy.spawn, busy.trainer.endpoint, "--rate", "8", name="joiner")
    joiner = _id_of(busy.trainer, worker.pid)
    assert joiner not in before.received
    busy.trained_more(joiner, before, 3)
    busy.trained_more(busy.base, before, 1)  # the others are still served
    started.signal(signal.SIGTERM)
    assert started.wait(30) == 0


def test_kill_9_of_a_producer_mid_send(busy):
    """A producer killed while it pushes (unthrottled, so always mid-send) loses only what it
    still held: the tail of its sequence, which no receiver can see. What arrived is complete
    and contiguous, a torn multipart message is discarded by ZeroMQ (never a drop), the
    others keep training, and its supervisor reports the death."""
    started, worker = _produce(
        busy.spawn, busy.trainer.endpoint, "--inflight-mb", str(INFLIGHT_MB), name="victim"
    )
    victim = _id_of(busy.trainer, worker.pid)
    before = busy.trained_more(victim, busy.trainer.metrics(), 2)
    worker.send_signal(signal.SIGKILL)
    assert started.wait(30) == 3  # "producer processes failed"
    assert "exit -9" in procs.log_text(started)
    after = busy.trained_more(busy.base, busy.trainer.metrics(), 3)
    assert after.missing[victim] == 0
    assert after.dropped == before.dropped


def test_lost_connection_shows_as_a_sequence_gap_not_a_drop(busy):
    """A producer whose connection is cut loses what was on the wire; when it carries on (on a
    new connection, with new books under the same name) the trainer reports the hole as
    ``seq_missing``, apart from drops. The cut here is the trainer's own: a message over
    --max-message-mb (one batch + 1 MiB by default)."""
    ctx = zmq.Context()
    peer = Peer(ctx, busy.trainer.endpoint, "gap-test",
                monitor_events=zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    monitor = peer.monitor
    assert monitor is not None
    try:
        before = busy.trainer.metrics()
        assert _event(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert peer.hello()["t"] == "welcome"
        for seq in range(4):
            peer.send_batch(seq)
        busy.trainer.wait_metrics(lambda m: m.received.get("gap-test") == 4, WAIT_S)
        header = msgpack.packb({"v": 2, "t": "batch", "seq": 4, "arrays": [["x", "|u1", [1]]]})
        peer.send_batch(4, [header, np.zeros(8 * procs.MIB, dtype=np.uint8)])
        assert [_event(monitor), _event(monitor)] == [
            zmq.EVENT_DISCONNECTED,
            zmq.EVENT_HANDSHAKE_SUCCEEDED,
        ]
        peer.credit = 0  # a new connection: the trainer does not know it yet
        assert peer.hello()["t"] == "welcome"
        for seq in range(5, 8):
            peer.send_batch(seq)
        after = busy.trainer.wait_metrics(
            lambda m: sum(v for k, v in m.received.items() if k.startswith("gap-test")) == 7,
            WAIT_S,
        )
    finally:
        monitor.close(linger=0)
        peer.close()
        ctx.term()
    mine = [k for k in after.received if k.startswith("gap-test")]
    assert len(mine) == 2  # one entry per connection
    assert sum(after.missing.get(k, 0) for k in mine) == 1
    assert after.dropped == before.dropped


def _event(monitor: zmq.Socket) -> int:
    assert monitor.poll(WAIT_S * 1000), "no socket event"
    return zmq.utils.monitor.recv_monitor_message(monitor)["event"]


def _held_batches(m: procs.Metrics) -> int:
    """Batches the trainer holds by its own books: received and not yet trained (handed over,
    queued, staged, or in the step)."""
    return sum(m.received.values()) - sum(m.trained.values())


def test_slow_trainer_blocks_producers_within_their_byte_budgets(busy):
    """An unthrottled producer against a trainer that takes ~20 batches/s blocks (backpressure)
    and stays within the budgets of common/options.py:

    - trainer, by its own books: the batches it received and has not trained, in bytes, stay
      within its bound on bytes held (``TrainerOptions.held_bytes_bound``,
      ``procs.trainer_budget_mib``) at every scrape under the flood;
    - trainer, measured: its peak RSS stays within that bound plus what malloc may keep of
      freed batch buffers (``procs.allocator_allowance_mib``: computed from its threads),
      above its steady peak RSS. Peaks are compared with peaks over whole train steps
      (``procs.PeakRss``): a step's working set comes and goes;
    - producer: ``max(1, inflight_mb // batch_mb)`` unsent batches plus one being filled;
      with --inflight-mb 8 that is 7 batch buffers (8.3 MiB) above the supervisor process,
      which imports the same modules and holds no batch.
    """
    trainer = busy.trainer
    peak = procs.PeakRss(trainer)
    steady_peak = peak.settled()  # the base producer alone, the queue near empty
    quiet = trainer.metrics()
    started, worker = _produce(
        busy.spawn, trainer.endpoint, "--inflight-mb", str(INFLIGHT_MB), name="flood"
    )
    flood = _id_of(trainer, worker.pid)
    # The queue (3 batches) is full by now: the flood is unthrottled, the step paced.
    live = busy.trained_more(flood, quiet, 6)
    peak.reset()
    worker_rss, held_batches = [], []
    for _ in range(5):
        live = busy.trained_more(flood, live, 3)
        worker_rss.append(procs.rss_mib(worker.pid))
        held_batches.append(_held_batches(live))
    flood_peak = peak.peak_mib(window=True)
    heap_free = trainer.metrics().heap_free_mib
    supervisor_rss = procs.rss_mib(started.proc.pid)
    started.signal(signal.SIGTERM)
    assert started.wait(30) == 0
    stopped = trainer.metrics()

    batch_mib = procs.BATCH_BYTES / procs.MIB
    max_unsent = int(INFLIGHT_MB * procs.MIB) // procs.BATCH_BYTES
    producer_budget = (max_unsent + 1) * batch_mib
    zmq_allowance = 16  # a ZeroMQ context, its I/O thread and the monitor socket
    assert max(worker_rss) <= supervisor_rss + producer_budget + zmq_allowance, (
        worker_rss,
        supervisor_rss,
    )
    # Every producer this trainer has seen counts, as if all were still connected.
    trainer_budget = procs.trainer_budget_mib(len(stopped.received))
    held_mib = max(held_batches) * batch_mib
    assert held_mib <= trainer_budget, (
        f"the trainer's books: up to {max(held_batches)} batches ({held_mib:.1f} MiB) received "
        f"and not trained under the flood > its bound {trainer_budget:.1f} MiB"
    )
    allowance = procs.allocator_allowance_mib(len(stopped.received))
    limit = steady_peak + trainer_budget + allowance
    assert flood_peak <= limit, (
        f"peak RSS {flood_peak:.1f} MiB under the flood > steady peak {steady_peak:.1f} + "
        f"budget {trainer_budget:.1f} + allowance {allowance:.1f} MiB; "
        f"malloc keeps {heap_free:.1f} MiB freed"
    )

    # Blocked, not buffering: what it handed over exceeds what the trainer received by at
    # most its own unsent budget (batches waiting for credit) plus the credit the trainer
    # granted it (batches on the wire or in the trainer's ZeroMQ queue, not yet booked).
    handed = int(re.search(r"(\d+) batches handed over", procs.log_text(started)).group(1))
    received = stopped.received[flood]
    on_the_way = max_unsent + CREDIT_PER_PRODUCER
    assert received <= handed <= received + on_the_way, (handed, received, on_the_way)


def test_trainer_killed_and_restarted_producers_resume(tmp_path):
    spawn = procs.Spawner(tmp_path)
    try:
        first = procs.Trainer(spawn, name="first")
        started, worker = _produce(
            spawn, first.endpoint, "--inflight-mb", str(INFLIGHT_MB), name="p"
        )
        producer = _id_of(first, worker.pid)
        os.killpg(first.pid, signal.SIGKILL)
        first.started.wait(30)
        assert procs.wait_log(started, "cannot reach the trainer", 30), procs.log_text(started)

        second = procs.Trainer(spawn, port=first.port, name="second")
        live = second.wait_metrics(lambda m: m.trained.get(producer, 0) >= 3, WAIT_S)
        assert live.trained.get(producer, 0) >= 3, "the running producer did not come back"
        assert worker.is_running() and started.proc.poll() is None  # never restarted
        # Its log up to now, when it trains again: once the second trainer stops too, the
        # producer says again that it cannot reach it (2 s later), while the stop goes on.
        log = procs.log_text(started)
        summary = second.stop()
        assert list(summary["producers"]) == [producer]
        assert log.count("cannot reach the trainer") == 1, log
        assert "reachable again" in log
        assert "Traceback" not in log
    finally:
        spawn.kill_all()
