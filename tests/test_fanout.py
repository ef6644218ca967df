"""One producer, several trainers (``producer.fanout``): every batch to exactly one, each
trainer's sequence whole, a trainer that is slow, absent or gone holding nobody up.

Real sockets on loopback against trainer stand-ins (``tests.helpers.standin_trainer``) that read
each
batch's number from its data: the producer writes its own count into every batch, so what
the trainers received together can be compared with what the producer made.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import ProducerOptions
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.producer.channel import TrainerChannel
from stagefeed.producer.fanout import Fanout, make_channel
from tests.conftest import free_tcp_port, wait_for
from tests.helpers.standin_trainer import StandInTrainer
from tests.test_producer_worker import Running

SMALL = Schema((ArraySpec("x", "float32", (16,)), ArraySpec("y", "int32")), batch_size=4)
OTHER = Schema((ArraySpec("x", "float32", (8,)), ArraySpec("y", "int32")), batch_size=4)
NEVER = threading.Event()


def numbered(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """Batch k of this producer holds k in every value (``--source tests.test_fanout:numbered``)."""
    k = 0
    while True:
        yield {name: np.full(shape, k, dtype) for name, dtype, shape in schema.wire()}
        k += 1


def number(seq: int, arrays: dict[str, np.ndarray]) -> int:
    return int(arrays["y"][0])


def trainer(**kwargs) -> StandInTrainer:
    kwargs.setdefault("regrant", True)
    return StandInTrainer(SMALL, inspect=number, **kwargs)


def options(*trainers: StandInTrainer | str, **kwargs) -> ProducerOptions:
    endpoints = tuple(t if isinstance(t, str) else t.endpoint for t in trainers)
    return ProducerOptions(connect=endpoints, source="tests.test_fanout:numbered", **kwargs)


def check_whole(trainers: list[StandInTrainer], made: int) -> None:
    """Each trainer got seq 0..n-1 in order and an ``end`` saying n; together they got each of
    the producer's batches exactly once."""
    numbers: list[int] = []
    for t in trainers:
        count = len(t.received)
        assert t.seqs() == list(range(count)), t.seqs()
        assert [seq for _, seq in t.ends] == [count]
        numbers += [r.summary for r in t.received]
    assert sorted(numbers) == list(range(made))


def test_make_channel_is_a_plain_channel_for_one_trainer_and_a_fanout_for_several():
    one = make_channel(ProducerOptions(connect="tcp://127.0.0.1:9"), "p", None)
    several = ProducerOptions(connect=("tcp://127.0.0.1:9", "tcp://127.0.0.1:10"))
    two = make_channel(several, "p", None)
    try:
        assert isinstance(one, TrainerChannel) and isinstance(two, Fanout)
        assert two.endpoint == "tcp://127.0.0.1:9, tcp://127.0.0.1:10"
        # one thread a trainer, named by it (a thread dump tells them apart)
        assert [c._thread.name for c in two.channels] == [
            "stagefeed-channel tcp://127.0.0.1:9", "stagefeed-channel tcp://127.0.0.1:10"
        ]  # fmt: skip
    finally:
        one.close()
        two.close()


def test_every_batch_goes_to_exactly_one_trainer_and_both_get_some():
    with trainer() as a, trainer() as b:
        assert Running(options(a, b, max_batches=40)).join() == 40
        assert wait_for(lambda: a.ends and b.ends, 10)
        check_whole([a, b], 40)
        assert len(a.received) > 0 and len(b.received) > 0


def test_a_trainer_without_credit_holds_nobody_up():
    """``a`` grants its first 2 credits and no more (a stalled worker): the rest goes to ``b``."""
    with trainer(regrant=False) as a, trainer() as b:
        assert Running(options(a, b, max_batches=30)).join() == 30
        assert wait_for(lambda: a.ends and b.ends, 10)
        check_whole([a, b], 30)
        assert len(a.received) <= 2 and len(b.received) >= 28


def test_a_trainer_that_never_comes_holds_nobody_up_and_gets_no_end():
    absent = f"tcp://127.0.0.1:{free_tcp_port()}"
    with trainer() as b:
        assert Running(options(absent, b, max_batches=12)).join() == 12
        assert wait_for(lambda: b.ends, 10)
        check_whole([b], 12)


def test_trainers_that_disagree_on_the_schema_fail_the_producer():
    with StandInTrainer(SMALL, regrant=True) as a, StandInTrainer(OTHER, regrant=True) as b:
        running = Running(ProducerOptions(connect=(a.endpoint, b.endpoint), max_batches=50))
        with pytest.raises(ConfigError, match="expects .* another one welcomed this producer"):
            running.join()


def test_a_trainer_lost_mid_run_is_logged_by_endpoint_and_the_other_keeps_training(caplog):
    caplog.set_level(logging.INFO, logger="stagefeed.producer")
    b = trainer()
    try:
        with trainer() as a:
            running = Running(options(a, b, rate=100.0))
            both = wait_for(lambda: len(a.received) >= 3 and len(b.received) >= 3, 10)
            assert both, (len(a.received), len(b.received))
        lost = f"lost the trainer at {a.endpoint}"
        assert wait_for(lambda: any(lost in r.getMessage() for r in caplog.records), 10)
        before = len(b.received)
        assert wait_for(lambda: len(b.received) >= before + 20, 10)  # b alone, still fed
        running.stop.set()
        with pytest.raises(Exception, match="stop requested"):
            running.join()
    finally:
        b.close()
    numbers = [r.summary for r in a.received + b.received]
    assert len(numbers) == len(set(numbers))  # none twice


def test_a_lost_connection_hands_back_what_it_had_not_sent():
    """A channel made to hand back (``hand_back``) returns a batch still waiting for credit
    when its trainer goes, with its ``on_release``, and counts the loss."""
    a = StandInTrainer(SMALL, credit=0)
    channel = TrainerChannel(a.endpoint, "p", SMALL, max_unsent=4, hand_back=True)
    released: list[int] = []
    try:
        channel.open(NEVER)
        arrays = {name: np.zeros(shape, dtype) for name, dtype, shape in SMALL.wire()}
        channel.send(arrays, 0, NEVER, on_release=lambda: released.append(0))
        assert channel.waiting() == 1 and channel.free_credit() == -1
        a.close()
        returned: list = []

        def handed_back() -> bool:
            channel.poll()
            returned.extend(channel.take_returned())
            return bool(returned)

        assert wait_for(handed_back, 10)
        [(out, on_release)] = returned
        assert out.seq == 0 and channel.held() == 0 and channel.waiting() == 0
        assert channel.trainers() == {a.endpoint: {"sent": 0, "lost": 1}}
        assert on_release is not None and released == []
        on_release()
        assert released == [0]
    finally:
        channel.close()
        a.close()
