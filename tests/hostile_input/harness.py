"""What every hostile-input test shares: the trainer under test (``Target``), its memory
gauges (``procs.PeakRss``, the heap in use), new connections to it and their ``end``
(``say_end``), and the checks each case runs (``check_cases``: exactly the expected drops,
training goes on, memory within the budget)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable

import pytest
import zmq

from tests.helpers import procs
from tests.hostile import wire
from tests.hostile.peers import Peer

MAX_MESSAGE_MB = 3
# Peers that may hold a message in the trainer's ZeroMQ queues at once: the good producer,
# the hostile DEALER of a test, and the two oversize senders.
PEERS = 4
# The trainer's byte budget (common/options.py, TrainerOptions) plus what malloc may keep of
# freed batch buffers (procs.allocator_allowance_mib says how that is computed).
RSS_BUDGET_MIB = procs.trainer_budget_mib(PEERS, MAX_MESSAGE_MB) + procs.allocator_allowance_mib(
    PEERS, MAX_MESSAGE_MB
)
HEAP_IN_USE = ("stagefeed_heap_in_use_bytes", ())
WAIT_S = 60
POLL_S = 0.05
_names = itertools.count()


@dataclasses.dataclass
class Target:
    trainer: procs.Trainer
    good: str | None  # the good producer's metrics label (None: labels are off)
    good_proc: object  # its process
    ctx: zmq.Context
    baseline_mib: float  # the trainer's steady peak RSS once training settled
    peak: procs.PeakRss
    high_mib: float = 0.0  # its peak RSS over every test so far
    booked: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    cut_peers: int = 0
    # Sockets closed only after the trainer stops: closing one is a disconnect it would count.
    keep_open: list = dataclasses.field(default_factory=list)

    def metrics(self) -> procs.Metrics:
        return self.trainer.metrics()

    def wait(self, predicate: Callable[[procs.Metrics], bool], timeout: float = WAIT_S):
        """Scrape every ``POLL_S`` until ``predicate`` holds; the last scrape either way."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m) or time.monotonic() >= deadline:
                return m
            time.sleep(POLL_S)


def trained_total(m: procs.Metrics) -> int:
    return procs.steps_of(m)


def heap_in_use_floor_mib(target: Target) -> float:
    """The least heap in use (``stagefeed_heap_in_use_bytes``) scraped every ``POLL_S`` over
    ``procs.PeakRss.WINDOW_STEPS`` whole train steps: what the trainer holds between steps,
    without a step's temporaries."""
    seen: list[float] = []
    want = trained_total(target.metrics()) + procs.PeakRss.WINDOW_STEPS + 1

    def window_done(m: procs.Metrics) -> bool:
        if HEAP_IN_USE not in m.samples:
            pytest.skip("no heap figures: malloc is not glibc >= 2.33")
        seen.append(m.samples[HEAP_IN_USE] / procs.MIB)
        return trained_total(m) >= want

    last = target.wait(window_done)
    require(trained_total(last) >= want, f"the trainer did not train {want} steps in {WAIT_S} s")
    return min(seen)


def good_trained(target: Target, m: procs.Metrics) -> int:
    """The good producer's trained batches (all trained batches if labels are off)."""
    if target.good is None:
        return trained_total(m)
    return m.trained.get(target.good, 0)


def new_peer(target: Target, name: str | None = None, hello: bool = True) -> Peer:
    """A new DEALER connection, kept open until the trainer stops; says hello as ``name``."""
    p = Peer(target.ctx, target.trainer.endpoint, timeout_s=WAIT_S)
    target.keep_open.append(p)
    if hello:
        reply = p.hello(name or f"hostile-{next(_names)}")
        require(reply["t"] == "welcome", f"hello refused: {reply}")
    return p


def _welcomes(p: Peer) -> int:
    return sum(reply["t"] == "welcome" for reply in p.replies)


def say_end(target: Target, p: Peer) -> None:
    """``end`` from a connection that said hello (its unused credit back to the pool), and
    the drop it causes booked. A connection whose messages were all dropped before the intake
    saw who sent them is silent to the trainer, and forgotten after --producer-timeout-s
    (10 s, which a slow test outlasts on a loaded machine): its ``end`` is then a
    ``no_hello`` drop. A hello after it is answered once the trainer has handled the end (one
    connection, in order), so the drop, if any, is on the counters then; a second ``end``
    hands back what that hello was granted."""
    before = target.metrics()
    welcomes = _welcomes(p)
    p.send(wire.control("end", seq=0))
    p.send(wire.hello(p.name or "hostile-end"))
    require(p.wait(lambda: _welcomes(p) > welcomes), "no welcome for the hello after end")
    caused = delta(target.metrics().dropped, before.dropped)
    require(caused in ({}, {"no_hello": 1}), f"an end caused {caused}")
    target.booked.update(caused)
    p.send(wire.control("end", seq=0))


def require(condition: bool, message: str) -> None:
    """A precondition, not the property under test: fails (not xfails) a test marked xfail."""
    if not condition:
        pytest.fail(message)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    keys = set(after) | set(before)
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)
    }


@dataclasses.dataclass
class Case:
    """Messages of one case and the drops they must cause, exactly.

    ``credit``: each message is a batch that gets past the header: it is sent against a
    credit, and the peer must get one ``dropped`` verdict per message with the reason booked.
    """

    id: str
    messages: list[list]
    expected: dict[str, int]
    credit: bool = False


def one(id: str, frames: list, reason: str, credit: bool = False) -> Case:
    return Case(id, [frames], {reason: 1}, credit)


def check_dropped(target: Target, peer: Peer, case: Case) -> procs.Metrics:
    """Send the case's messages; the drop counters move by exactly ``case.expected``."""
    before = target.metrics()
    verdicts = len(peer.verdicts)
    for frames in case.messages:
        if case.credit:
            peer.send_batch(frames)
        else:
            peer.send(frames)
    want = sum(case.expected.values())
    after = target.wait(lambda m: sum(delta(m.dropped, before.dropped).values()) >= want)
    if case.credit:  # the verdicts come after the drops are booked
        assert peer.wait(lambda: len(peer.verdicts) - verdicts >= len(case.messages)), case.id
        after = target.metrics()
    assert delta(after.dropped, before.dropped) == case.expected, case.id
    target.booked.update(case.expected)
    if case.credit:
        reasons = collections.Counter(v["reason"] for v in peer.verdicts[verdicts:])
        assert reasons == collections.Counter(case.expected), (case.id, peer.verdicts[verdicts:])
    return after


def check_cases(target: Target, cases: list[Case], peer: Peer | None = None) -> procs.Metrics:
    """Each case drops exactly what it says, then the trainer still trains, within memory.

    ``peer``: the connection to send from (default: a new one per case that said hello).
    Memory: the trainer's peak RSS during the cases stays within the budget above its peak
    before.
    """
    start = target.metrics()
    target.peak.reset()
    for case in cases:
        if peer is not None:
            check_dropped(target, peer, case)
            continue
        fresh = new_peer(target)
        check_dropped(target, fresh, case)
        say_end(target, fresh)
    after = check_still_training(target, start)
    check_peak(target)
    return after


def check_peak(target: Target) -> None:
    """The trainer's peak RSS since the last reset is within the budget above the peak it had
    before (it keeps freed memory: what a test needs beyond that is what it costs)."""
    peak = target.peak.peak_mib()
    assert peak <= target.high_mib + RSS_BUDGET_MIB, (
        f"trainer peak RSS {peak:.1f} MiB > its peak before {target.high_mib:.1f} MiB "
        f"+ budget and allocator allowance {RSS_BUDGET_MIB:.1f} MiB"
    )
    target.high_mib = max(target.high_mib, peak)


def check_still_training(target: Target, since: procs.Metrics) -> procs.Metrics:
    """The good producer's batches keep being trained; RSS stays within the byte budget."""
    trainer = target.trainer
    assert trainer.started.proc.poll() is None, procs.log_text(trainer.started)
    was = good_trained(target, since)
    now = target.wait(lambda m: good_trained(target, m) > was)
    assert good_trained(target, now) > was, (
        f"the trainer trained none of the good producer's batches in {WAIT_S} s"
    )
    if target.good is not None:
        assert now.missing.get(target.good, 0) == 0
        assert now.received.get(target.good, 0) >= now.trained.get(target.good, 0)
    rss = procs.rss_mib(trainer.pid)
    assert rss <= target.high_mib + RSS_BUDGET_MIB, (
        f"trainer RSS {rss:.1f} MiB > its peak before {target.high_mib:.1f} MiB "
        f"+ budget and allocator allowance {RSS_BUDGET_MIB:.1f} MiB"
    )
    return now


H = wire.header
W = wire.with_header
