"""Advice: the rules on chosen figures, then on figures from controlled real runs."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from stagefeed.consumer.observe import advice
from stagefeed.consumer.observe.advice import advise, producers_needed
from tests.conftest import TINY, run_cli
from tests.helpers.figures_util import window

MIB = 2**20


def test_the_issue_example_reads_as_written() -> None:
    # One producer delivering 2.1 batches/s; the step alone takes 1/3 s; 31% of step time waited.
    f = window(seconds=10, steps=21, wait_s=7.0 * 0.31 / 0.69, step_s=7.0, per_producer={"a": 21})
    result = advise(f)
    assert result.kind == advice.INPUT_BOUND
    assert result.text == (
        "input-bound: 31% of step time waiting for data; producers deliver 2.1 batches/s, "
        "the step consumes 3.0: about 1 more producer needed"
    )


def test_input_bound_counts_the_producers_missing() -> None:
    # Two producers at 2 batches/s each; the step could take 10/s: 5 needed, 3 more.
    f = window(seconds=10, steps=20, wait_s=6.0, step_s=2.0, per_producer={"a": 20, "b": 20})
    result = advise(f)
    assert result.kind == advice.INPUT_BOUND
    assert "75% of step time waiting" in result.text
    assert result.text.endswith("about 3 more producers needed")


def test_input_bound_on_a_saturated_host_sends_the_producers_elsewhere() -> None:
    # 3 more producers needed (as above), on a host whose 2 cores were 97% busy: not here.
    f = window(seconds=10, steps=20, wait_s=6.0, step_s=2.0, per_producer={"a": 20, "b": 20})
    result = advise(dataclasses.replace(f, host_cores=2, host_busy_pct=97.0))
    assert result.kind == advice.INPUT_BOUND
    assert result.text.endswith(
        "about 3 more producers needed, on other hosts: this host's 2 cores are 97% busy, so "
        "producers here would only slow the others"
    ), result.text


def test_input_bound_asks_for_no_more_producers_here_than_idle_cores() -> None:
    f = window(seconds=10, steps=20, wait_s=6.0, step_s=2.0, per_producer={"a": 20, "b": 20})
    room_for_one = advise(dataclasses.replace(f, host_cores=4, host_busy_pct=70.0))
    assert room_for_one.text.endswith(
        "about 3 more producers needed; this host's 4 cores are 70% busy: about 1 here, the "
        "rest on other hosts"
    ), room_for_one.text
    none = advise(dataclasses.replace(f, host_cores=1, host_busy_pct=60.0))
    assert none.text.endswith("this host's 1 core is 60% busy: none here, the rest on other hosts")
    # Enough idle cores, or their use unknown: the count alone, as before.
    for host in [{"host_cores": 16, "host_busy_pct": 10.0}, {"host_cores": 2}]:
        plain = advise(dataclasses.replace(f, **host))
        assert plain.text.endswith("about 3 more producers needed"), plain.text


def test_input_bound_without_deliveries_says_so() -> None:
    f = window(seconds=10, steps=5, wait_s=8.0, step_s=0.5, per_producer={"a": 0})
    result = advise(f)
    assert result.kind == advice.INPUT_BOUND
    assert "no producer delivered a batch in the last 10 s" in result.text


def test_input_bound_without_a_step_rate_names_no_producer_count() -> None:
    # Steps of no measurable time (a run that failed at its first checkpoint): the rate the
    # step consumes is unknown, so no count of producers is advised (it once raised).
    f = window(seconds=10, steps=5, wait_s=8.0, step_s=0.0, per_producer={"a": 20})
    result = advise(f)
    assert result.kind == advice.INPUT_BOUND
    assert result.text.endswith("producers deliver 2.0 batches/s"), result.text


def test_wire_bound_when_receiving_near_the_link() -> None:
    # 100 float32 batches of 1.18 MiB in 10 s: 11.8 MiB/s on a 12 MiB/s link.
    f = window(seconds=10, steps=100, wait_s=5.0, step_s=5.0, per_producer={"a": 100})
    assert f.received_mb_per_s == pytest.approx(100 * f.batch_mb / 10)
    result = advise(f, wire_mb_s=12.0)
    assert result.kind == advice.WIRE_BOUND
    assert result.text.endswith("(--dtype uint8 for images) to move 4x fewer bytes")
    # The same figures on a link with room: more producers, not fewer bytes.
    assert advise(f, wire_mb_s=1000.0).kind == advice.INPUT_BOUND


def test_wire_bound_when_the_step_needs_more_than_the_link() -> None:
    # Receiving little (1 batch/s) but the step would take 40 batches/s = 47 MiB/s > 30.
    f = window(seconds=10, steps=10, wait_s=9.75, step_s=0.25, per_producer={"a": 10})
    assert advise(f, wire_mb_s=30.0).kind == advice.WIRE_BOUND
    uint8 = window(
        seconds=10,
        steps=10,
        wait_s=9.75,
        step_s=0.25,
        per_producer={"a": 10},
        batch_bytes=2 * 227 * 227 * 3,
        wire_dtype="uint8",
    )
    result = advise(uint8, wire_mb_s=5.0)
    assert result.kind == advice.WIRE_BOUND
    assert result.text.endswith("only fewer bytes per batch or a faster link will help")


def test_compute_bound_with_a_full_queue_reduces_producers() -> None:
    # Step takes 10 batches/s; one producer was seen delivering 10/s unthrottled; 4 run.
    f = window(
        steps=20,
        wait_s=0.001,
        step_s=2.0,
        full_steps=19,
        queue_batches=100,
        per_producer={"a": 5, "b": 5, "c": 5, "d": 5},
        producer_capacity_per_s=10.0,
    )
    result = advise(f)
    assert result.kind == advice.COMPUTE_BOUND
    assert result.text == (
        "compute-bound: queue full 95% of the time; producers can be reduced to 2"
    )


def test_compute_bound_keeps_producers_that_are_just_enough() -> None:
    common = dict(steps=20, wait_s=0.0, step_s=2.0, full_steps=20, queue_batches=100)
    two = window(per_producer={"a": 10, "b": 10}, producer_capacity_per_s=6.5, **common)
    assert advise(two).text.endswith("2 producers are just enough")
    unknown = window(per_producer={"a": 10, "b": 10}, **common)
    assert advise(unknown).text.endswith("more producers will not help")


def test_compute_bound_while_the_queue_fills() -> None:
    # 100 batches received in 10 s, 20 trained: the queue grows; it never was full at a step.
    f = window(steps=20, wait_s=0.0, step_s=2.0, queue_batches=80, per_producer={"a": 100})
    result = advise(f)
    assert result.kind == advice.COMPUTE_BOUND
    assert "queue filling (80 of 100 batches)" in result.text
    assert "producers deliver 10.0 batches/s, the step consumes 10.0" in result.text


def test_balanced_and_unknown() -> None:
    f = window(steps=20, wait_s=0.04, step_s=2.0, queue_sum=40, per_producer={"a": 20})
    result = advise(f)
    assert result.kind == advice.BALANCED
    assert result.text.startswith("balanced: 2.0% of step time waiting for data, queue 2 of 100")
    one = advise(window(steps=1))
    assert one.kind == advice.UNKNOWN
    assert "1 steps in 10 s" in one.text


def test_drops_and_gaps_are_appended() -> None:
    f = window(
        steps=20, wait_s=0.0, step_s=2.0, dropped={"duplicate": 3, "dtype": 1}, seq_missing=2
    )
    text = advise(f).text
    assert text.endswith(
        "; 4 messages dropped (dtype 1, duplicate 3); 2 batches missing (sequence gaps)"
    )


def test_producers_needed() -> None:
    assert producers_needed(3.0, 2.1) == 2
    assert producers_needed(4.0, 2.0) == 2  # exactly enough: no extra for rounding noise
    assert producers_needed(0.5, 2.0) == 1
    with pytest.raises(ValueError):
        producers_needed(3.0, 0.0)
    with pytest.raises(ValueError):
        producers_needed(math.nan, 1.0)


# -- controlled real runs: real producers, real trainer, the advice printed and in --json ----


# A starved run by construction: a model whose step takes milliseconds on any machine of
# this class, fed one batch a second (an AlexNet step beside a CPU hog took over a second and
# judged a 1-batch/s run balanced).
TINY_MODEL = [
    "--schema", "tests.helpers.regression_models:SCHEMA", "--source",
        "tests.helpers.regression_models:sums",
    "--model", "tests.helpers.regression_models:linear_fn",
]  # fmt: skip


def _run(tmp_path, *flags: str, job: list[str] = TINY) -> dict:
    summary_path = tmp_path / "summary.json"
    proc = run_cli(["run", *job, "--json", str(summary_path), *flags], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert f"advice: {summary['advice']}" in proc.stdout
    return summary


@pytest.mark.slow
def test_slow_producers_make_a_run_input_bound(tmp_path) -> None:
    # One producer limited to 1 batch/s; the step takes milliseconds.
    summary = _run(
        tmp_path, "--producers", "1", "--rate", "1", "--steps", "4", "--warmup-steps", "1",
        job=TINY_MODEL,
    )
    assert summary["bottleneck"] == "input-bound", summary["advice"]
    assert summary["stall_pct"] > advice.INPUT_BOUND_STALL_PCT
    assert "more producer" in summary["advice"]


@pytest.mark.slow
def test_fast_producers_make_a_run_compute_bound(tmp_path) -> None:
    # Two unlimited producers of 64-byte batches and a step that sleeps 2 s: the queue fills
    # at once and stays full, at any load (AlexNet's step on batches of 2 was assumed slower
    # than two producers, which a loaded machine need not keep).
    slow_step = [*TINY_MODEL[:4], "--model", "tests.helpers.regression_models:slow_linear_fn"]
    summary = _run(
        tmp_path, "--producers", "2", "--steps", "4", "--warmup-steps", "1", job=slow_step
    )
    assert summary["bottleneck"] == "compute-bound", summary["advice"]
    assert summary["stall_pct"] < advice.INPUT_BOUND_STALL_PCT


@pytest.mark.slow
def test_a_narrow_link_makes_a_float32_run_wire_bound(tmp_path) -> None:
    # The same starved run on a link declared at 0.001 MiB/s: a step of milliseconds on
    # 64-byte batches needs more than that (tens of KiB/s), so fewer bytes is the advice.
    summary = _run(
        tmp_path,
        *("--producers", "1", "--rate", "1", "--steps", "4", "--warmup-steps", "1"),
        *("--wire-mb-s", "0.001"),
        job=TINY_MODEL,
    )
    assert summary["bottleneck"] == "wire-bound", summary["advice"]
    assert summary["advice"].endswith("(--dtype uint8 for images) to move 4x fewer bytes")
