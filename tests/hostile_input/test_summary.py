"""The last test of the package: stop the trainer, and its JSON summary books every case the
other tests booked (``conftest.py`` runs it after them; with none of them selected, it is
skipped)."""

from __future__ import annotations

import time

import pytest

from tests.hostile_input.harness import RSS_BUDGET_MIB

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

CONNECTION_KIB = 32  # libzmq's buffers per TCP connection (28 KiB measured, pyzmq 27 / 4.3.5)


def test_summary_books_every_case(target):
    """Stop the trainer: the JSON summary has every drop by reason, and the cut peers."""
    # The good producer first, so no batch is in flight when the trainer stops (see
    # test_sizes_and_floods.py::test_a_batch_in_flight_at_stop_does_not_hang_the_intake).
    target.good_proc.signal()
    target.good_proc.wait(30)
    time.sleep(1)
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
