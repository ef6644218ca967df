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
from stagefeed.common.ledger import Ledger
from stagefeed.consumer.figures import RunFacts, RunReader
from stagefeed.consumer.monitor import Monitor, ObserveOptions, unthrottled_producer_rate
from stagefeed.consumer.trainer import StepRecord

from tests.figures_util import BATCH_BYTES, window

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


def test_final_window_starts_after_the_warm_up() -> None:
    monitor, ledger = _started()
    # Two slow warm-up steps that waited long, then three timed steps that never waited.
    _steps(monitor, ledger, [(False, 5.0, 3.0)] * 2 + [(True, 0.0, 0.1)] * 3)
    f = monitor.final_figures()
    assert f.steps == 3
    assert f.stall_pct == 0.0
    assert f.compute_ms == pytest.approx(100.0)
    monitor.close()
    assert set(monitor.final) == {"advice", "bottleneck"}
    assert monitor.final["advice"].startswith(monitor.final["bottleneck"] + ": ")
    monitor.close()  # idempotent


def test_final_window_falls_back_to_the_whole_run() -> None:
    monitor, ledger = _started()
    _steps(monitor, ledger, [(False, 1.0, 1.0)] * 2)  # stopped during warm-up
    assert monitor.final_figures().steps == 2
    monitor.close()
    assert monitor.final["bottleneck"] == "input-bound"


def test_a_monitor_never_started_closes_without_figures() -> None:
    monitor = Monitor(ObserveOptions(), stream=io.StringIO())
    monitor.close()
    assert monitor.final == {}


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
    assert monitor.final_figures().producer_capacity_per_s == monitor.capacity_per_s
    monitor.close()
