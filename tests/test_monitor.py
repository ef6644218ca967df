"""Monitor: options checks, when it shows and advises, the final window, producer capacity.

Driven with real ``StepRecord``s and a real ``Ledger``, seen through the ``RunFacts`` and
``RunReader`` a trainer hands its monitor: no trainer, no TensorFlow session.
"""

from __future__ import annotations

import io
import logging
import math
import time

import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import ObserveOptions, TrainerOptions
from stagefeed.common.schema import image_schema
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.graph.trainer import Trainer
from stagefeed.consumer.observe.monitor import Monitor, unthrottled_producer_rate
from stagefeed.consumer.observe.summary import format_text, summarize
from stagefeed.consumer.run_facts import RunFacts, RunReader, StepRecord
from tests.helpers.figures_util import BATCH_BYTES, window

SPEC = image_schema(batch_size=2)

# --steps 3 --warmup-steps 2: five steps planned.
FACTS = RunFacts("/cpu:0", 2, BATCH_BYTES, "float32", queue_capacity=20, steps_planned=5)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("progress_s", 0),
        ("advice_s", -1.0),
        ("wire_mb_s", float("nan")),
        ("tensorboard_s", float("inf")),
        ("metrics_port", 70000),
        ("metrics_port", -1),
        ("logdir", "  "),
        ("metrics_bind", ""),
        ("metrics_bind", "not a host!"),
        ("metrics_bind", "*"),
    ],
)
def test_bad_options_name_the_value(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        ObserveOptions(**{field: value})


def _started(options: ObserveOptions | None = None) -> tuple[Monitor, Ledger]:
    ledger = Ledger()
    monitor = Monitor(options or ObserveOptions(), stream=io.StringIO())
    return monitor.start(FACTS, RunReader(lambda: 0, ledger.read)), ledger


def _steps(monitor: Monitor, ledger: Ledger, specs: list[tuple[bool, float, float]]) -> None:
    """Feed (timed, wait_s, step_s) steps, each ending ``wait_s + step_s`` after the last."""
    at = time.monotonic()
    index = ledger.open("prod-a")
    for n, (timed, wait_s, step_s) in enumerate(specs, start=1):
        ledger.accept(index, n, 100)
        at += wait_s + step_s
        monitor.on_step(StepRecord(n, timed, wait_s, step_s, 6.9, 0, at))


def test_progress_lines_and_advice_lines_when_due(caplog) -> None:
    monitor, ledger = _started(ObserveOptions(progress_s=1.0, advice_s=2.0))
    caplog.set_level(logging.INFO)
    # Steps 1.5 s apart (by their end times): a line each, advice every second step.
    _steps(monitor, ledger, [(True, 1.0, 0.5)] * 4)
    progress = [r.message for r in caplog.records if r.name == "stagefeed.progress"]
    advice = [r.message for r in caplog.records if r.name == "stagefeed.monitor"]
    assert len(progress) == 4
    assert progress[-1].startswith("step 4/5  ")
    assert "stall 67%" in progress[-1]
    assert len(advice) == 2
    assert all(a.startswith("advice: ") for a in advice)
    monitor.close()


def test_final_figures_start_after_the_warm_up() -> None:
    monitor, ledger = _started()
    # Two slow warm-up steps that waited long, then three timed steps: 100, 200 and 400 ms.
    _steps(monitor, ledger, [(False, 5.0, 3.0)] * 2 + [(True, 0.0, 0.1), (True, 0.1, 0.1),
                                                      (True, 0.0, 0.4)])  # fmt: skip
    monitor.close()
    final = monitor.final
    assert final is not None
    assert final.window.steps == 3 and final.window.last_step == 5
    assert final.window.stall_pct == pytest.approx(100 * 0.1 / 0.7)
    assert final.window.compute_ms == pytest.approx(200.0)
    # numpy's linear interpolation over the timed steps only: [100, 200, 400].
    assert final.median_ms == pytest.approx(200.0)
    assert final.p10_ms == pytest.approx(120.0)
    assert final.p90_ms == pytest.approx(360.0)
    assert final.advice.text.startswith(final.advice.kind + ": ")
    assert final.advice == monitor.advice(final.window)
    monitor.close()  # idempotent
    assert monitor.final is final


def test_without_warm_up_the_final_figures_start_after_the_first_step() -> None:
    monitor, ledger = _started()
    _steps(monitor, ledger, [(True, 2.0, 5.0), (True, 0.0, 0.1), (True, 0.0, 0.3)])
    monitor.close()
    assert monitor.final is not None
    assert monitor.final.window.steps == 2 and monitor.final.window.stall_pct == 0.0
    assert monitor.final.median_ms == pytest.approx(200.0)


def test_final_figures_fall_back_to_the_whole_run() -> None:
    monitor, ledger = _started()
    _steps(monitor, ledger, [(False, 1.0, 1.0), (False, 1.0, 3.0)])  # stopped during warm-up
    monitor.close()
    assert monitor.final is not None
    assert monitor.final.window.steps == 2
    assert monitor.final.median_ms == pytest.approx(3000.0)
    assert monitor.final.advice.kind == "input-bound"


def test_a_monitor_never_started_closes_without_figures() -> None:
    monitor = Monitor(ObserveOptions(), stream=io.StringIO())
    monitor.close()
    assert monitor.final is None


def test_the_summary_takes_the_final_figures_as_they_are() -> None:
    monitor, ledger = _started()
    index = ledger.open("prod-a")
    _steps(monitor, ledger, [(False, 1.0, 1.0)] * 2 + [(True, 0.1, 0.2)] * 3)
    for seq in range(100, 110):  # delivered after the warm-up: in the final window
        ledger.accept(index, seq, BATCH_BYTES)
    monitor.close()
    final = monitor.final
    assert final is not None and final.window.received_mb_per_s > 0
    # The summary's own books are a trainer's (never started); its step figures are the
    # monitor's.
    trainer = Trainer(TrainerOptions(bind="tcp://127.0.0.1:*", schema=SPEC, steps=3))
    summary = summarize(trainer.report(), final, wall_s=10.0, interrupted=False)
    assert summary["median_ms"] == summary["p10_ms"] == summary["p90_ms"] == 300.0
    assert summary["stall_pct"] == round(final.window.stall_pct, 2) == 33.33
    assert summary["examples_per_s"] == round(final.window.examples_per_s, 2)
    # received: over the time the batches came (from the first to the last), not the window's
    assert summary["received_mb_per_s"] == round(final.received_mb_per_s, 6)
    assert final.received_mb_per_s > 0
    assert (summary["advice"], summary["bottleneck"]) == (final.advice.text, final.advice.kind)
    assert "advice: " + final.advice.text in format_text(summary)

    # Memory: this process's peak RSS, the options' bound for the producers seen (none: no
    # connection adds its high-water mark), and malloc's figures.
    memory = summary["memory"]
    assert memory["held_bound_mb"] == round(trainer.options.held_bytes_bound(0) / 2**20, 1)
    assert memory["bound_producers"] == 0
    assert memory["peak_rss_mb"] > memory["heap_in_use_mb"] > 0  # TensorFlow is imported
    assert memory["heap_free_mb"] >= 0
    assert f"memory: peak RSS {memory['peak_rss_mb']} MiB" in format_text(summary)

    never = summarize(trainer.report(), None, wall_s=1.0, interrupted=True)
    assert never["median_ms"] is never["stall_pct"] is never["examples_per_s"] is None
    assert "advice" not in never and "bottleneck" not in never


def test_producer_capacity_only_from_windows_with_room_in_the_queue() -> None:
    free = window(seconds=2, steps=4, per_producer={"a": 20, "b": 10}, queue_batches=10)
    assert unthrottled_producer_rate(free, queue_at_start=5) == pytest.approx(7.5)
    # Full at the start, at the end, or at any step: producers were held back.
    assert unthrottled_producer_rate(free, queue_at_start=100) is None
    at_end = window(seconds=2, steps=4, per_producer={"a": 20}, queue_batches=100)
    assert unthrottled_producer_rate(at_end, queue_at_start=0) is None
    at_step = window(seconds=2, steps=4, per_producer={"a": 20}, full_steps=1)
    assert unthrottled_producer_rate(at_step, queue_at_start=0) is None
    idle = window(seconds=2, steps=4, per_producer={"a": 0})
    assert unthrottled_producer_rate(idle, queue_at_start=0) is None


def test_capacity_is_the_best_sample_so_far() -> None:
    monitor, ledger = _started()
    assert math.isnan(monitor.capacity_per_s)
    _steps(monitor, ledger, [(True, 0.5, 0.7)] * 3)  # windows >= 1 s: sampled
    assert monitor.capacity_per_s > 0
    monitor.close()
    assert monitor.final is not None
    assert monitor.final.window.producer_capacity_per_s == monitor.capacity_per_s


def test_a_record_of_several_steps_counts_each_of_them() -> None:
    """Keras' ``steps_per_execution``: one record per call of 4 steps. The window counts 4
    steps a call, each taking a quarter of the call (it said the call's time as ms/step, and
    a quarter of the examples/s, before); the final window starts after the first call,
    which holds step 1."""
    monitor, ledger = _started()
    index = ledger.open("prod-a")
    at = time.monotonic()
    for call in range(1, 4):  # steps 4, 8, 12; a call of 0.4 s, no wait
        for seq in range(4 * call - 4, 4 * call):
            ledger.accept(index, seq, 100)
        at += 0.4
        monitor.on_step(StepRecord(4 * call, True, 0.0, 0.4, 6.9, 0, at, steps=4))
    monitor.close()
    final = monitor.final
    assert final is not None
    assert final.window.steps == 8 and final.window.last_step == 12  # after the first call
    assert final.median_ms == pytest.approx(100.0)
    assert final.window.compute_ms == pytest.approx(100.0)
