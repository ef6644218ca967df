"""TrainerChannel against a real ROUTER peer speaking protocol v2
(``tests.helpers.standin_trainer``).

Real sockets on loopback, real threads; the stand-in is a peer, not a mock of the channel.
"""

from __future__ import annotations

import logging
import math
import threading

import numpy as np
import pytest
import zmq

from stagefeed.common.errors import BrokenError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import ArraySpec, Schema, SchemaMismatch
from stagefeed.producer.channel import TrainerChannel
from tests.conftest import wait_for
from tests.helpers.standin_trainer import StandInTrainer

SMALL = Schema((ArraySpec("x", "float32", (16,)), ArraySpec("y", "int32")), batch_size=4)
# The shape of review finding 9: a large zero-copy frame, then a small last one (copied).
LARGE = Schema((ArraySpec("x", "float32", (2**21,)), ArraySpec("y", "int32")), batch_size=4)
NEVER = threading.Event()
WAIT_S = 10.0


def _kernel_buffer_bytes() -> int:
    """The most a loopback TCP connection's kernel buffers can hold: the receiver's and the
    sender's autotuning maxima (``tcp_rmem``/``tcp_wmem``; ZeroMQ sets no SO_RCVBUF/SO_SNDBUF)."""
    with open("/proc/sys/net/ipv4/tcp_rmem") as rmem, open("/proc/sys/net/ipv4/tcp_wmem") as wmem:
        return int(rmem.read().split()[2]) + int(wmem.read().split()[2])


# Batches one of which ZeroMQ must still hold while the stand-in does not read: its reader
# may take one before it sees the pause, its pipe (rcvhwm 1) one more, and the kernel's buffers
# what they can, so the third batch's large frame is ZeroMQ's if it is larger than those
# buffers (with 32 MiB batches it was not: tcp_rmem's maximum is 32 MiB on some kernels).
BEYOND_KERNEL = Schema(
    (ArraySpec("x", "float32", (math.ceil((_kernel_buffer_bytes() + 2**22) / 16),)),
     ArraySpec("y", "int32")),
    batch_size=4,
)  # fmt: skip


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
        assert wait_for(lambda: len(trainer.received) == 2, WAIT_S), trainer.seqs()
        # Its thread takes commands in order: the Finish after the six batches, due at once,
        # makes it say what it could not send once it had all six and no credit left.
        drained = channel.finish(6, NEVER, timeout_s=0)
        assert drained.unsent == 4 and not drained.end_sent, drained
        assert trainer.seqs() == [0, 1] and channel.waiting() == 4
        trainer.grant(3)
        assert wait_for(lambda: len(trainer.received) == 5, WAIT_S), trainer.seqs()
        # A ping goes out only after the batches its thread may send, so once one arrived
        # after the fifth batch, a sixth sent on wrong credit would have arrived before it.
        fifth = trainer.received[-1].at
        assert wait_for(lambda: any(at > fifth for _, at in trainer.pings), WAIT_S), (
            f"no ping within {WAIT_S} s of the fifth batch"
        )
        assert trainer.seqs() == [0, 1, 2, 3, 4] and channel.waiting() == 1
        trainer.grant(1)
        assert wait_for(lambda: channel.held() == 0, WAIT_S), channel.held()
        assert trainer.seqs() == list(range(6)) and channel.refused() == {}


def _paused_and_moved(channel: TrainerChannel) -> bool:
    """All three batches given to ZeroMQ, and it let go of one: the stand-in's pipe took a
    whole batch while its reader is paused (the point where a channel that released early
    would show none held)."""
    return channel.waiting() == 0 and channel.held() < 3


def test_held_is_true_while_zeromq_holds_a_large_batch(channels):
    with StandInTrainer(BEYOND_KERNEL, credit=3, rcvhwm=1) as trainer:
        channel = channels(trainer.endpoint, BEYOND_KERNEL, max_unsent=3)
        channel.open(NEVER)
        trainer.reading.clear()  # the trainer stops reading: its pipe and the kernel fill
        for seq in range(3):
            channel.send(batch(BEYOND_KERNEL, seq), seq, NEVER)
        assert wait_for(lambda: _paused_and_moved(channel), WAIT_S), (
            f"ZeroMQ did not take all three and let go of one within {WAIT_S} s "
            f"(waiting {channel.waiting()}, held {channel.held()})"
        )
        held = channel.held()  # nothing more can move while the trainer does not read
        assert held >= 1 and channel.in_zeromq() == held, (held, channel.in_zeromq())
        trainer.reading.set()
        assert wait_for(lambda: channel.held() == 0, WAIT_S), channel.held()
        assert wait_for(lambda: trainer.seqs() == [0, 1, 2], WAIT_S), trainer.seqs()


def test_release_callbacks_run_only_after_zeromq_let_go(channels):
    released: list[int] = []
    # Three batches larger than the kernel's buffers (``BEYOND_KERNEL``): one is still ZeroMQ's.
    with StandInTrainer(BEYOND_KERNEL, credit=3, rcvhwm=1) as trainer:
        channel = channels(trainer.endpoint, BEYOND_KERNEL, max_unsent=3)
        channel.open(NEVER)
        trainer.reading.clear()
        for seq in range(3):
            channel.send(
                batch(BEYOND_KERNEL, seq), seq, NEVER, on_release=lambda s=seq: released.append(s)
            )
        assert wait_for(lambda: _paused_and_moved(channel), WAIT_S), (
            f"ZeroMQ did not take all three and let go of one within {WAIT_S} s"
        )
        held = channel.held()  # one call: the callbacks it runs are the ones it counts
        assert held >= 1 and len(released) == 3 - held, (held, released)
        trainer.reading.set()
        assert wait_for(lambda: channel.held() == 0, WAIT_S), channel.held()
    assert sorted(released) == [0, 1, 2]


def test_reconnect_after_the_trainer_restarts_says_hello_again(channels, caplog):
    caplog.set_level(logging.INFO, logger="stagefeed.producer")
    first = StandInTrainer(SMALL, credit=1)
    channel = channels(first.endpoint, None, name="survivor")
    channel.open(NEVER)
    channel.send(batch(SMALL, 0), 0, NEVER)
    assert wait_for(lambda: first.seqs() == [0], WAIT_S), first.seqs()
    first.bye()
    first.bye()
    # A credit after the byes, on the same connection: the batch it carries arrives only once
    # the channel handled both byes (in order), before the stand-in goes away.
    first.grant(1)
    channel.send(batch(SMALL, 1), 1, NEVER)
    assert wait_for(lambda: first.seqs() == [0, 1], WAIT_S), first.seqs()
    first.close()
    channel.send(batch(SMALL, 2), 2, NEVER)  # waits: no trainer, no credit
    with StandInTrainer(SMALL, endpoint=first.endpoint, credit=1) as second:
        assert wait_for(lambda: second.seqs() == [2], WAIT_S), second.seqs()
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
        assert wait_for(lambda: len(trainer.hellos) == 2, WAIT_S), trainer.hellos
        channel.send(batch(SMALL, 0), 0, NEVER)
        assert wait_for(lambda: trainer.seqs() == [0], WAIT_S), trainer.seqs()
        identities = {identity for identity, _ in trainer.hellos}
    assert len(identities) == 1 and channel.refused() == {}


def test_pings_keep_an_idle_channel_known(channels):
    # What a ping must beat: the trainer forgets a connection silent for this long. (A tighter
    # bound on the gap would depend on the channel's thread getting a CPU in time.)
    forgotten_after = TrainerOptions().producer_timeout_s
    with StandInTrainer(SMALL) as trainer:
        channels(trainer.endpoint, SMALL).open(NEVER)
        assert wait_for(lambda: len(trainer.pings) >= 2, 2 * forgotten_after), trainer.pings
    gap = trainer.pings[1][1] - trainer.pings[0][1]
    assert 1.5 < gap < forgotten_after  # every ~2 s (PING_S), never more often


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
        # The stand-in's own state: it ran the command (its thread runs commands in turn).
        assert wait_for(lambda: not trainer._known, WAIT_S), "the stand-in did not forget us"
        channel.send(batch(SMALL, 0), 0, NEVER)  # reaches a trainer that forgot us: dropped
        assert wait_for(lambda: len(trainer.hellos) == 2, WAIT_S), trainer.hellos
        channel.send(batch(SMALL, 1), 1, NEVER)  # against the new welcome's credit
        assert wait_for(lambda: trainer.seqs() == [1], WAIT_S), trainer.seqs()
        assert channel.refused() == {"no_hello": 1}
