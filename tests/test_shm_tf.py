"""TensorFlow keeps a fed shared-memory view alive through a FIFOQueue (graph mode), so the
finalizer is a correct "TF is done with this slot" signal (docs/shm.md, notes/shm.md).

The views fed are slices of the handed-out arrays, so this also shows that a derived view keeps
the slot's lease. TensorFlow runs in a child (``python -m tests.test_shm_tf child``) that prints
one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from stagefeed.common.shm.layout import SlotLayout
from stagefeed.common.shm.mapped import Descriptor, MappedPool
from stagefeed.common.shm.slots import SlotPool
from tests.conftest import REPO, cli_env

SHAPE = (256, 1024)  # 1 MiB of float32
N = SHAPE[0] * SHAPE[1]


@pytest.mark.slow
def test_finalizer_fires_only_after_the_dequeued_element_was_consumed():
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_shm_tf", "child"],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    first, second, control = got["slots"]
    assert got["aligned"] == [0, 0, 4]
    assert got["released_after_enqueue"] == []  # the queue holds both views
    # Control: a view 4 bytes off alignment is copied by TF, so its slot is released at once
    # (and a later write is not seen): the assertions here would catch a copying feed.
    assert got["released_after_control"] == [control]
    assert got["sum_control"] == N * 3.0
    # Written by the producer after the enqueue, seen in the dequeued element: an alias.
    assert got["sum_first"] == N * 1.0 - 1.0 + 1000.0
    assert got["released_after_first"] == [control, first]
    # The fetched element is a copy: it does not keep the second slot.
    assert got["released_after_second"] == [control, first, second]
    assert got["fetched_all_twos"] and not got["fetched_in_mapping"]


def _child() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    pool = SlotPool(SlotLayout.of([("x", np.float32, (N + 16,))]), 4)
    released: list[list[int]] = []
    mapped = MappedPool(os.dup(pool.fd), pool.announcement, lambda p, s, g: released.append([s, g]))
    graph = tf.Graph()
    with graph.as_default():
        feed = tf.compat.v1.placeholder(tf.float32, SHAPE)
        queue = tf.queue.FIFOQueue(4, [tf.float32], shapes=[SHAPE])
        enqueue = queue.enqueue([feed])
        element = queue.dequeue()
        consume = tf.reduce_sum(element)
        unrelated = tf.constant(1.0) + 1.0
    session = tf.compat.v1.Session(graph=graph)
    writable, descs, aligned = [], [], []
    for seq, value in enumerate((1.0, 2.0, 3.0)):
        slot = pool.acquire(timeout=5)
        writable.append(pool.arrays(slot)["x"])
        writable[-1].fill(value)
        descs.append(pool.commit(slot, seq))
        start = 1 if seq == 2 else 0  # the control is fed 4 bytes off alignment
        view = mapped.view(Descriptor.parse(descs[-1]))["x"][start : start + N].reshape(SHAPE)
        aligned.append(view.ctypes.data % 64)
        if seq == 0:  # where the trainer's mapping starts
            lo = view.ctypes.data - pool.layout.offsets[0] - slot * pool.layout.stride
        session.run(enqueue, {feed: view})
        del view
        gc.collect()
        for _ in range(3):
            session.run(unrelated)  # any pending decref would run here
        if seq == 1:
            after_enqueue = list(released)
    after_control = list(released)
    writable[2][1] = 1000.0  # after the control's enqueue: TF copied it, this is not seen
    writable[0][0] = 1000.0  # the producer writes after the enqueue
    sum_first = float(session.run(consume))
    after_first = list(released)
    fetched = session.run(element)
    # TensorFlow lets go of the dequeued tensor on one of its threads, after run() returned:
    # wait for that (while ``fetched`` lives: were it an alias, the slot would stay held).
    deadline = time.monotonic() + 30
    while len(released) < 3 and time.monotonic() < deadline:
        session.run(unrelated)
        time.sleep(0.01)
    after_second = list(released)
    in_mapping = lo <= fetched.ctypes.data < lo + pool.size
    sum_control = float(session.run(consume))
    result = {
        "slots": [[d["slot"], d["gen"]] for d in descs],
        "aligned": aligned,
        "released_after_enqueue": after_enqueue,
        "sum_first": sum_first,
        "released_after_first": after_first,
        "released_after_second": after_second,
        "fetched_all_twos": bool(np.all(fetched == 2.0)),
        "fetched_in_mapping": bool(in_mapping),
        "released_after_control": after_control,
        "sum_control": sum_control,
    }
    session.close()
    mapped.close()
    writable.clear()
    pool.close()
    print(json.dumps(result), flush=True)


@pytest.mark.slow
def test_tf2_queue_copies_a_slot_so_it_is_released_as_soon_as_enqueue_returns():
    """TF 2 mode (``consumer.tf2.eager_queue``) converts eagerly, which copies: shared memory
    saves the wire there, not the trainer's copy, and the slot comes back at once."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_shm_tf", "eager"],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["released_after_enqueue"] == [got["slot"]]
    assert got["dequeued_sum"] == N * 5.0  # the producer's later write is not in the queue


def _eager_child() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from stagefeed.common.schema import ArraySpec, Schema
    from stagefeed.consumer.tf2.eager_queue import EagerQueueFeed

    schema = Schema((ArraySpec("x", "float32", SHAPE[1:]),), batch_size=SHAPE[0])
    pool = SlotPool(SlotLayout.of(schema.wire()), 2)
    released: list[list[int]] = []
    mapped = MappedPool(os.dup(pool.fd), pool.announcement, lambda p, s, g: released.append([s, g]))
    feed = EagerQueueFeed(schema, 2)
    slot = pool.acquire(timeout=5)
    writable = pool.arrays(slot)["x"]
    writable.fill(5.0)
    desc = pool.commit(slot, 0)
    views = mapped.view(Descriptor.parse(desc))
    assert feed.enqueue(views, 0, 0)
    del views
    gc.collect()
    after_enqueue = list(released)
    writable.fill(-1.0)  # as a producer would, once released
    element = feed.queue.dequeue()
    print(json.dumps({
        "slot": [desc["slot"], desc["gen"]],
        "released_after_enqueue": after_enqueue,
        "dequeued_sum": float(element[0].numpy().sum()),
    }), flush=True)  # fmt: skip
    feed.close()
    mapped.close()
    del writable
    pool.close()


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    _child()
elif __name__ == "__main__" and sys.argv[1:] == ["eager"]:
    _eager_child()
