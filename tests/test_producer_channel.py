"""TrainerChannel against a real ROUTER peer speaking protocol v2 (``tests.standin_trainer``).

Real sockets on loopback, real threads; the stand-in is a peer, not a mock of the channel.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import zmq
from stagefeed.common.errors import BrokenError
from stagefeed.common.schema import ArraySpec, Schema, SchemaMismatch
from stagefeed.producer.channel import TrainerChannel

from tests.conftest import wait_for
from tests.standin_trainer import StandInTrainer

SMALL = Schema((ArraySpec("x", "float32", (16,)), ArraySpec("y", "int32")), batch_size=4)
# The shape of review finding 9: a large zero-copy frame, then a small last one (copied).
LARGE = Schema((ArraySpec("x", "float32", (2**21,)), ArraySpec("y", "int32")), batch_size=4)
NEVER = threading.Event()


def batch(schema: Schema, value: int = 0) -> dict[str, np.ndarray]:
    return {name: np.full(shape, value, dtype) for name, dtype, shape in schema.wire()}


@pytest.fixture
def channels():
    """``channels(endpoint, schema=None, name="p", max_unsent=4)``; all closed at teardown."""
    made: list[TrainerChannel] = []

    def make(endpoint, schema=None, name="p", max_unsent=4, **kwargs):
        channel = TrainerChannel(endpoint, name, schema, max_unsent=max_unsent, **kwargs)
        made.append(channel)
        return channel

    yield make
    for channel in made:
        channel.close()


def test_hello_carries_name_and_declared_schema(channels):
    with StandInTrainer(SMALL, credit=3) as trainer:
        welcome = channels(trainer.endpoint, SMALL, name="producer-a", max_unsent=2).open(NEVER)
        [(_, hello)] = trainer.hellos
    assert hello["name"] == "producer-a"
    assert Schema.from_dict(hello["schema"]) == SMALL
    assert (welcome.schema, welcome.credit, welcome.max_unsent) == (SMALL, 3, 2)


def test_no_declared_schema_adopts_the_welcomes(channels):
    with StandInTrainer(LARGE) as trainer:
        channel = channels(trainer.endpoint, None, max_unsent=lambda s: s.batch_size + 1)
        welcome = channel.open(NEVER)
        [(_, hello)] = trainer.hellos
    assert hello["schema"] is None
    assert welcome.schema == LARGE and welcome.max_unsent == 5  # max_unsent of the adopted one
    assert welcome.max_message == LARGE.batch_bytes + 2**20


def test_refused_hello_names_trainer_and_its_detail(channels):
    other = Schema((ArraySpec("x", "float64", (16,)), ArraySpec("y", "int32")), batch_size=4)
    with StandInTrainer(SMALL) as trainer, pytest.raises(SchemaMismatch) as info:
        channels(trainer.endpoint, other).open(NEVER)
    assert str(info.value) == (
        f"trainer at {trainer.endpoint}: x: producer sends float64[4, 16], "
        "trainer expects float32[4, 16]"
    )


def test_credit_bounds_what_is_sent(channels):
    with StandInTrainer(SMALL, credit=2) as trainer:
        channel = channels(trainer.endpoint, SMALL, max_unsent=6)
        channel.open(NEVER)
        for seq in range(6):
            channel.send(batch(SMALL, seq), seq, NEVER)
        assert wait_for(lambda: len(trainer.received) == 2, 5)
        time.sleep(0.5)  # time enough to over-send, were it possible
        assert trainer.seqs() == [0, 1] and channel.waiting() == 4
        trainer.grant(3)
        assert wait_for(lambda: len(trainer.received) == 5, 5)
        time.sleep(0.5)
        assert trainer.seqs() == [0, 1, 2, 3, 4] and channel.waiting() == 1
        trainer.grant(1)
        assert wait_for(lambda: channel.held() == 0, 5)
        assert trainer.seqs() == list(range(6)) and channel.refused() == {}


def test_held_is_true_while_zeromq_holds_a_large_batch(channels):
    with StandInTrainer(LARGE, credit=3, rcvhwm=1) as trainer:
        channel = channels(trainer.endpoint, LARGE, max_unsent=3)
        channel.open(NEVER)
        trainer.reading.clear()  # the trainer stops reading: its pipe and the kernel fill
        for seq in range(3):
            channel.send(batch(LARGE, seq), seq, NEVER)
        assert wait_for(lambda: channel.waiting() == 0, 5)  # all credited: given to ZeroMQ
        time.sleep(1.0)
        assert channel.in_zeromq() >= 1 and channel.held() == channel.in_zeromq()
        held = channel.held()
        time.sleep(0.5)
        assert channel.held() == held  # nothing moves while the trainer does not read
        trainer.reading.set()
        assert wait_for(lambda: channel.held() == 0, 10)
        assert wait_for(lambda: trainer.seqs() == [0, 1, 2], 5)


def test_release_callbacks_run_only_after_zeromq_let_go(channels):
    released: list[int] = []
    # Three 32 MiB batches: the stand-in's reader may take one more before it sees the pause,
    # its pipe holds one (rcvhwm 1), the kernel's buffers a few MiB: one is still ZeroMQ's.
    with StandInTrainer(LARGE, credit=3, rcvhwm=1) as trainer:
        channel = channels(trainer.endpoint, LARGE, max_unsent=3)
        channel.open(NEVER)
        trainer.reading.clear()
        for seq in range(3):
            channel.send(batch(LARGE, seq), seq, NEVER, on_release=lambda s=seq: released.append(s))
        time.sleep(1.0)
        assert channel.held() >= 1 and len(released) == 3 - channel.held()
        trainer.reading.set()
        assert wait_for(lambda: channel.held() == 0, 10)
    assert sorted(released) == [0, 1, 2]


def test_reconnect_after_the_trainer_restarts_says_hello_again(channels, caplog):
    caplog.set_level(logging.INFO, logger="stagefeed.producer")
    first = StandInTrainer(SMALL, credit=1)
    channel = channels(first.endpoint, None, name="survivor")
    channel.open(NEVER)
    channel.send(batch(SMALL, 0), 0, NEVER)
    assert wait_for(lambda: first.seqs() == [0], 5)
    first.bye()
    first.bye()
    time.sleep(0.3)
    first.close()
    channel.send(batch(SMALL, 1), 1, NEVER)  # waits: no trainer, no credit
    with StandInTrainer(SMALL, endpoint=first.endpoint, credit=1) as second:
        assert wait_for(lambda: second.seqs() == [1], 10)
        [(_, hello)] = second.hellos
    assert hello["name"] == "survivor"
    assert Schema.from_dict(hello["schema"]) == SMALL  # the adopted schema is now declared
    closing = [r for r in caplog.records if "is closing; waiting" in r.getMessage()]
    assert len(closing) == 1


def test_a_trainer_that_forgot_us_gets_hello_again_on_the_same_connection(channels):
    with StandInTrainer(SMALL, credit=1) as trainer:
        channel = channels(trainer.endpoint, SMALL)
        channel.open(NEVER)
        trainer.forget()  # as after ~10 s of silence: the next ping is refused (no_hello)
        assert wait_for(lambda: len(trainer.hellos) == 2, 10)
        channel.send(batch(SMALL, 0), 0, NEVER)
        assert wait_for(lambda: trainer.seqs() == [0], 5)
        identities = {identity for identity, _ in trainer.hellos}
    assert len(identities) == 1 and channel.refused() == {}


def test_pings_keep_an_idle_channel_known(channels):
    with StandInTrainer(SMALL) as trainer:
        channels(trainer.endpoint, SMALL).open(NEVER)
        assert wait_for(lambda: len(trainer.pings) >= 2, 8)
    gap = trainer.pings[1][1] - trainer.pings[0][1]
    assert 1.5 < gap < 3.0


def test_a_refused_handshake_is_broken(channels):
    public, secret = zmq.curve_keypair()
    server_public, _ = zmq.curve_keypair()

    def configure(socket):
        socket.curve_secretkey, socket.curve_publickey = secret, public
        socket.curve_serverkey = server_public

    refused = pytest.raises(BrokenError, match="refused the handshake .*check --curve-keys")
    with StandInTrainer(SMALL) as trainer, refused:  # plain text: CURVE mechanism mismatch
        channels(trainer.endpoint, SMALL, configure=configure).open(NEVER)


def test_a_batch_dropped_for_no_hello_is_counted_and_hello_follows(channels):
    with StandInTrainer(SMALL, credit=1) as trainer:
        channel = channels(trainer.endpoint, SMALL)
        channel.open(NEVER)
        trainer.forget()
        time.sleep(0.2)
        channel.send(batch(SMALL, 0), 0, NEVER)  # reaches a trainer that forgot us: dropped
        assert wait_for(lambda: len(trainer.hellos) == 2, 5)
        channel.send(batch(SMALL, 1), 1, NEVER)  # against the new welcome's credit
        assert wait_for(lambda: trainer.seqs() == [1], 5)
        assert channel.refused() == {"no_hello": 1}
