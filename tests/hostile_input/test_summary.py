"""The last test of the package: stop the trainer, and its JSON summary books every case the
other tests booked (``conftest.py`` runs it after them; with none of them selected, it is
skipped)."""

from __future__ import annotations

import pytest

from tests.helpers import procs
from tests.hostile_input.harness import RSS_BUDGET_MIB, WAIT_S

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

# What libzmq allocates for each TCP connection it accepts, with its defaults: the decoder's
# receive buffer (ZMQ_IN_BATCH_SIZE, 8 KiB, and a reference count for each of the up to 249
# small messages in it, 40 B each: 18 KiB in all), the encoder's send buffer
# (ZMQ_OUT_BATCH_SIZE, 8 KiB), and a pipe each way whose first chunk holds 256 zmq_msg_t of
# 64 B (16 KiB each): 58 KiB; 64 with the objects that own them. An upper bound on what a
# connection adds to RSS, which counts only the pages written.
CONNECTION_KIB = 64


def test_summary_books_every_case(target):
    """Stop the trainer: the JSON summary has every drop by reason, and the cut peers."""
    # The good producer first, so no batch is in flight when the trainer stops (see
    # test_sizes_and_floods.py::test_a_batch_in_flight_at_stop_does_not_hang_the_intake):
    # until the trainer has seen it go and its queue is empty (it took every batch received).
    gone = procs.disconnections_of(target.metrics()) + 1
    target.good_proc.signal()
    assert target.good_proc.wait(30) == 0, procs.log_text(target.good_proc)
    settled = target.wait(
        lambda m: (
            procs.disconnections_of(m) >= gone and m.samples[("stagefeed_queue_batches", ())] == 0
        )
    )
    assert procs.disconnections_of(settled) >= gone, (
        f"the good producer's going not seen in {WAIT_S} s"
    )
    assert settled.samples[("stagefeed_queue_batches", ())] == 0, "the queue is not empty"
    summary = target.trainer.stop()
    for p in target.keep_open:
        p.close()
    assert summary["dropped_by_reason"] == dict(target.booked)
    assert summary["batches"]["dropped"] == sum(target.booked.values())
    good = summary["producers"][target.good or "good"]
    assert good["dropped"] == {} and good["seq_missing"] == 0 and good["trained"] > 0
    assert good["seq_duplicates"] == 0 and good["trained_duplicates"] == 0
    # The peers libzmq cut, and the good producer's own disconnection when it stopped.
    assert summary["connections"].get("disconnected", 0) == target.cut_peers + 1
    # Connections of the hello flood delivered nothing: forgotten, not in the books.
    assert not [name for name in summary["producers"] if name.startswith("flood-")]
    # Every trained batch is one a connection's books received (the loss is not what this
    # package tests: its trainer runs with --on-nan warn).
    books = summary["producers"].values()
    assert summary["batches"]["trained"] == sum(p["trained"] for p in books)
    assert all(p.get("trained_duplicates", 0) == 0 for p in books)
    # Over the whole package: the budget, plus libzmq's buffers for every connection it took.
    connections = summary["connections"]["accepted"]
    bound = target.baseline_mib + RSS_BUDGET_MIB + connections * CONNECTION_KIB / 1024
    assert target.high_mib <= bound, (
        f"trainer peak RSS {target.high_mib:.1f} MiB over the package > steady peak "
        f"{target.baseline_mib:.1f} + budget {RSS_BUDGET_MIB:.1f} + {connections} connections "
        f"x {CONNECTION_KIB} KiB"
    )
