"""Hostile and malformed input against one real trainer process that keeps training.

One ``stagefeed train`` process (module fixture) trains on a good producer's batches while each
test sends its messages from a raw pyzmq PUSH socket (or a raw TCP socket speaking ZMTP). The
trainer's live counters are read from its Prometheus endpoint, so every case checks exactly
what it caused: the drop counters by reason move by the expected amounts and nothing else
moves, the good producer's trained count grows afterwards, and the trainer's RSS stays within
its byte budget above the RSS measured once training was steady. The last test stops the
trainer and checks the JSON summary books every case.
"""

from __future__ import annotations

import collections
import dataclasses

import msgpack
import numpy as np
import pytest
import zmq
import zmq.utils.monitor

from tests import hostile, procs
from tests.conftest import TINY

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

GOOD_RATE = "4"  # batches/s: below what the trainer takes, so junk is handled promptly
MAX_MESSAGE_MB = 3
# Peers that may hold a message in the trainer's ZeroMQ queues at once: the good producer,
# the hostile PUSH socket, and the two oversize senders.
PEERS = 4
# The trainer's byte budget (common/options.py, TrainerOptions) plus allocator retention.
RSS_BUDGET_MIB = procs.trainer_budget_mib(PEERS, MAX_MESSAGE_MB) + procs.ALLOCATOR_ALLOWANCE_MIB
WAIT_S = 60


@dataclasses.dataclass
class Target:
    trainer: procs.Trainer
    good: str  # the good producer's id
    ctx: zmq.Context
    push: zmq.Socket
    baseline_rss_mib: float
    booked: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    cut_peers: int = 0
    # Sockets closed only after the trainer stops: closing one is a disconnect it would count.
    keep_open: list = dataclasses.field(default_factory=list)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    spawn = procs.Spawner(tmp_path_factory.mktemp("hostile"))
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDTIMEO, WAIT_S * 1000)
    try:
        trainer = procs.Trainer(spawn, "--max-message-mb", str(MAX_MESSAGE_MB))
        spawn(["produce", "--connect", trainer.endpoint, *TINY, "--rate", GOOD_RATE], name="good")
        steady = trainer.wait_metrics(lambda m: sum(m.trained.values()) >= 4, 120)
        assert len(steady.trained) == 1, procs.log_text(trainer.started)
        push.connect(trainer.endpoint)
        yield Target(trainer, next(iter(steady.trained)), ctx, push, procs.rss_mib(trainer.pid))
    finally:
        spawn.kill_all()
        push.close(linger=0)
        ctx.destroy(linger=0)


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    keys = set(after) | set(before)
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)
    }


def check_dropped(target: Target, messages: list[list], expected: dict[str, int], sock=None):
    """Send ``messages``; the drop counters move by exactly ``expected``; training goes on."""
    trainer = target.trainer
    before = trainer.metrics()
    for frames in messages:
        (sock or target.push).send_multipart(frames)
    want = sum(expected.values())
    after = trainer.wait_metrics(
        lambda m: sum(_delta(m.dropped, before.dropped).values()) >= want, WAIT_S
    )
    assert _delta(after.dropped, before.dropped) == expected
    target.booked.update(expected)
    check_still_training(target, after)


def check_still_training(target: Target, since: procs.Metrics) -> None:
    """The good producer's batches keep being trained; RSS stays within the byte budget."""
    good, trainer = target.good, target.trainer
    was = since.trained[good]
    now = trainer.wait_metrics(lambda m: m.trained.get(good, 0) > was, WAIT_S)
    assert now.trained[good] > was, "the trainer stopped training on the good producer"
    assert now.missing.get(good, 0) == 0
    rss = procs.rss_mib(trainer.pid)
    assert rss <= target.baseline_rss_mib + RSS_BUDGET_MIB, (
        f"trainer RSS {rss:.1f} MiB > steady {target.baseline_rss_mib:.1f} MiB "
        f"+ budget and allocator allowance {RSS_BUDGET_MIB:.1f} MiB"
    )


def test_garbage_bytes(target):
    messages = [
        [hostile.garbage(64), hostile.garbage(1000), hostile.garbage(10)],
        [hostile.garbage(100)],
    ]
    check_dropped(target, messages, {"header_not_msgpack": 1, "parts": 1})


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([hostile.header()], id="header-only"),
        pytest.param(hostile.with_header(hostile.header())[:2], id="labels-missing"),
        pytest.param([*hostile.with_header(hostile.header()), b"x"], id="one-extra"),
        pytest.param([hostile.header()] + [b"x"] * 20, id="twenty-frames"),
    ],
)
def test_too_few_or_too_many_parts(target, frames):
    check_dropped(target, [frames], {"parts": 1})


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b'{"v": 1, "producer": "json", "seq": 0}', id="json"),
        pytest.param(hostile.header()[:-5], id="truncated"),
        pytest.param(msgpack.packb(msgpack.ExtType(1, b"ext")), id="extension-type"),
        pytest.param(hostile.garbage(200), id="garbage"),
    ],
)
def test_header_not_msgpack(target, head):
    check_dropped(target, [hostile.with_header(head)], {"header_not_msgpack": 1})


@pytest.mark.parametrize("value", [[1, "x"], 7, "header", b"header", None], ids=repr)
def test_header_not_a_map(target, value):
    check_dropped(target, [hostile.with_header(msgpack.packb(value))], {"header_not_map": 1})


@pytest.mark.parametrize("version", [2, 0, "1", None, 2**40], ids=repr)
def test_unknown_protocol_version(target, version):
    check_dropped(target, [hostile.with_header(hostile.header(v=version))], {"version": 1})


@pytest.mark.parametrize("dtype", ["|O", "<c8", "|V8", "<U1", ">f4", "|S4", "<M8[s]", "float32"])
def test_disallowed_dtype(target, dtype):
    check_dropped(target, [hostile.images_declared(dtype)], {"dtype": 1})


@pytest.mark.parametrize(
    "where, reason",
    [("header", "header_fields"), ("object-images", "dtype"), ("labels-frame", "frame_size")],
)
def test_msgpack_numpy_pickle_is_never_unpickled(target, tmp_path, where, reason):
    # Positive control: msgpack-numpy's own decoder runs the pickle and creates the file.
    control = tmp_path / "control-created"
    hostile.msgpack_numpy_decodes(hostile.msgpack_numpy_payload(control))
    assert control.exists()

    marker = tmp_path / "trainer-must-not-create"
    payload = hostile.msgpack_numpy_payload(marker)
    frames = {
        "header": hostile.with_header(payload),
        "object-images": hostile.images_declared("|O", [1], payload),
        "labels-frame": hostile.with_header(hostile.header(), label_bytes=payload),
    }[where]
    check_dropped(target, [frames], {reason: 1})
    assert not marker.exists(), "the trainer unpickled received bytes"


@pytest.mark.parametrize(
    "image_bytes",
    [
        pytest.param(bytes(hostile.images().nbytes - 1), id="one-byte-short"),
        pytest.param(bytes(hostile.images().nbytes + 4), id="four-bytes-long"),
        pytest.param(b"", id="empty-frame"),
    ],
)
def test_shape_and_frame_size_disagree(target, image_bytes):
    frames = hostile.with_header(hostile.header(), image_bytes)
    check_dropped(target, [frames], {"frame_size": 1})


def test_huge_declared_size_with_a_small_frame(target):
    # Every dimension allowed, their product ~2**124 bytes: compared, never allocated.
    frames = hostile.images_declared("<f4", [2**31 - 1] * 4, frame=b"\0" * 16)
    check_dropped(target, [frames], {"frame_size": 1})


@pytest.mark.parametrize(
    "shape",
    [[-2, 227, 227, 3], [0, 227, 227, 3], [2**40, 227, 227, 3], [1] * 9, [], [2.0, 227, 227, 3]],
    ids=["negative", "zero", "huge", "nine-dims", "no-dims", "float-dim"],
)
def test_negative_zero_or_huge_dimensions(target, shape):
    check_dropped(target, [hostile.images_declared("<f4", shape, frame=b"\0" * 16)], {"shape": 1})


@pytest.mark.parametrize(
    "values",
    [(0, -1), (hostile.NUM_CLASSES, 0), (np.iinfo(np.int32).min, np.iinfo(np.int32).max)],
    ids=["negative", "num-classes", "int32-extremes"],
)
def test_labels_outside_num_classes(target, values):
    frames = hostile.with_header(hostile.header(), label_bytes=hostile.labels(values).tobytes())
    check_dropped(target, [frames], {"label_range": 1})


@pytest.mark.parametrize(
    "arrays",
    [
        pytest.param([["images", "<f4", [2, 100, 100, 3]], ["labels", "<i4", [2]]], id="size"),
        pytest.param([["images", "|u1", [2, 227, 227, 3]], ["labels", "<i4", [2]]], id="uint8"),
        pytest.param([["pixels", "<f4", [2, 227, 227, 3]], ["labels", "<i4", [2]]], id="names"),
    ],
)
def test_well_formed_but_not_the_trainers_spec(target, arrays):
    image_bytes = bytes(int(np.prod(arrays[0][2])) * np.dtype(arrays[0][1]).itemsize)
    frames = hostile.with_header(hostile.header(arrays=arrays), image_bytes)
    check_dropped(target, [frames], {"spec_mismatch": 1})


@pytest.mark.parametrize("producer", ["", "has space", "x" * 65, "../../etc", 17], ids=repr)
def test_bad_producer_id(target, producer):
    frames = hostile.with_header(hostile.header(producer=producer))
    check_dropped(target, [frames], {"producer_id": 1})


def test_oversized_header(target):
    arrays = [["images", "<f4", hostile.IMAGE_SHAPE], ["labels", "<i4", [2]]] + [
        ["x" * 60, "<f4", [1]]
    ] * 80
    check_dropped(target, [hostile.with_header(hostile.header(arrays=arrays))], {"header_size": 1})


def test_replayed_message_is_dropped_as_duplicate(target):
    frames = hostile.good_frames("replay-test", 0)
    check_dropped(target, [frames, frames], {"duplicate": 1})
    assert target.trainer.metrics().received["replay-test"] == 1


def test_message_over_max_message_mb_declared_raw(target):
    """A frame header declaring 1 TiB: libzmq refuses it from the header and cuts the peer."""
    peer = hostile.RawZmtpPeer(target.trainer.port)
    try:
        # Control: a valid batch over the same hand-made connection is received and booked.
        peer.send_message(hostile.good_frames("zmtp-control", 0))
        control = target.trainer.wait_metrics(lambda m: "zmtp-control" in m.received, WAIT_S)
        assert control.received["zmtp-control"] == 1
        peer.send_frame_header(2**40)
        assert peer.closed_by_peer(), "the trainer kept a peer that declared a 1 TiB message"
    finally:
        peer.close()
    target.cut_peers += 1
    after = target.trainer.metrics()
    assert _delta(after.dropped, control.dropped) == {}  # cut, not counted as a message
    check_still_training(target, after)


def test_message_over_max_message_mb_real(target):
    """A real 64 MiB message from pyzmq: rejected before the trainer allocates it."""
    sock = target.ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, WAIT_S * 1000)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(target.trainer.endpoint)
    try:
        sock.send_multipart(hostile.good_frames("big-control", 0))
        before = target.trainer.wait_metrics(lambda m: "big-control" in m.received, WAIT_S)
        big = np.zeros(64 * procs.MIB, dtype=np.uint8)
        sock.send_multipart(hostile.with_header(hostile.header(), memoryview(big)), copy=False)
        assert monitor.poll(WAIT_S * 1000), "the trainer did not cut the oversize sender"
        event = zmq.utils.monitor.recv_monitor_message(monitor)
        assert event["event"] == zmq.EVENT_DISCONNECTED
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        target.keep_open.append(sock)
    target.cut_peers += 1
    after = target.trainer.metrics()
    assert _delta(after.dropped, before.dropped) == {}
    assert after.received["big-control"] == 1
    check_still_training(target, after)


def test_flood_of_small_junk(target):
    flood = 20_000
    check_dropped(target, [[b"junk"]] * flood, {"parts": flood})


def test_summary_books_every_case(target):
    """Stop the trainer: the JSON summary has every drop by reason, and the cut peers."""
    summary = target.trainer.stop()
    for sock in target.keep_open:
        sock.close(linger=0)
    assert summary["dropped_by_reason"] == dict(target.booked)
    good = summary["producers"][target.good]
    assert good["dropped"] == {} and good["seq_missing"] == 0 and good["trained"] > 0
    assert summary["connections"].get("disconnected", 0) == target.cut_peers
    assert summary["loss_finite"]
