"""Finite data in graph mode: when every producer said end, the queued and staged tail is
trained and the loop ends by itself (no lost tail)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf
import zmq

from stagefeed.common import protocol
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.consumer.graph.trainer import Trainer

pytestmark = pytest.mark.slow
v1 = tf.compat.v1
SCHEMA = Schema((ArraySpec("x", "float32", (3,)), ArraySpec("y", "float32")), 4)


def linear(staged, schema):
    w = v1.get_variable("w", [3, 1], initializer=v1.zeros_initializer())
    loss = tf.reduce_mean(tf.square(tf.squeeze(staged["x"] @ w, 1) - staged["y"]))
    return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)


@pytest.mark.parametrize("batches", [1, 7])
def test_every_batch_of_a_finite_source_is_trained(batches):
    options = TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=SCHEMA, steps=0, warmup_steps=0, queue_mb=1,
        stage_depth=2,
    )  # fmt: skip
    trainer = Trainer(options, model_fn=linear).start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        done = threading.Event()
        loop = threading.Thread(target=lambda: (trainer.train(threading.Event()), done.set()))
        loop.start()
        sock.connect(trainer.endpoint)
        sock.send(protocol.encode_control("hello", name="finite", schema=SCHEMA.to_dict()))
        credit, seq, rng = 0, 0, np.random.default_rng(0)
        while seq < batches:
            assert sock.poll(10_000)
            reply = protocol.decode_header(sock.recv(), protocol.FROM_TRAINER)
            credit += reply.get("credit", 0) + reply.get("n", 0)
            while credit and seq < batches:
                x = rng.random((4, 3), dtype=np.float32)
                sock.send_multipart(protocol.encode_batch(seq, [("x", x), ("y", x.sum(1))]))
                seq, credit = seq + 1, credit - 1
        sock.send(protocol.encode_control("end", seq=batches))
        loop.join(30)
        assert done.is_set(), "the train loop did not end at the end of data"
        assert trainer.data_ended and trainer.steps_done == batches
        summary = trainer.ledger.summary()["finite"]
        assert (summary["received"], summary["trained"], summary["queued_at_stop"]) == (
            batches, batches, 0
        )
        assert summary["trained_duplicates"] == 0 and summary["ended_after"] == batches
    finally:
        trainer.close()
        sock.close(linger=0)
        ctx.term()
