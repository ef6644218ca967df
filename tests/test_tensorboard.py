"""TensorBoard output, read back with TensorFlow's own summary iterator."""

from __future__ import annotations

import collections
import glob
import json
import math
import threading

import pytest
import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import ObserveOptions
from stagefeed.common.schema import image_schema
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.observe.figures import StepCounters, figures_between, take_snapshot
from stagefeed.consumer.observe.monitor import Monitor
from stagefeed.consumer.observe.tensorboard import TensorBoardWriter
from stagefeed.consumer.run_facts import RunFacts, RunReader, StepRecord
from tests.conftest import TINY, run_cli

SPEC = image_schema(batch_size=2)
FACTS = RunFacts("/cpu:0", 2, SPEC.batch_bytes, "float32", queue_capacity=20)
STEP_TAGS = ("step/ms", "step/wait_ms", "step/compute_ms", "step/loss", "step/queue_batches")


def read_events(logdir: str) -> tuple[dict[str, dict[int, float]], dict[str, str], dict]:
    """Scalars as {tag: {step: value}}, texts as {tag: text}, plugin names by tag."""
    scalars: dict[str, dict[int, float]] = collections.defaultdict(dict)
    texts: dict[str, str] = {}
    plugins: dict[str, str] = {}
    files = glob.glob(f"{logdir}/events.out.tfevents.*")
    assert len(files) == 1, files
    for event in tf.compat.v1.train.summary_iterator(files[0]):
        for v in event.summary.value:
            plugins[v.tag] = v.metadata.plugin_data.plugin_name
            array = tf.make_ndarray(v.tensor)
            if array.dtype == object:
                texts[v.tag] = array.item().decode()
            else:
                assert event.step not in scalars[v.tag], (v.tag, event.step)
                scalars[v.tag][event.step] = float(array)
    return scalars, texts, plugins


@pytest.mark.slow
def test_a_real_run_writes_scalars_tensorboard_can_read(tmp_path) -> None:
    logdir, summary_path = str(tmp_path / "tb"), tmp_path / "summary.json"
    proc = run_cli(
        ["run", *TINY, "--producers", "1", "--steps", "6", "--queue-mb", "24",
         "--logdir", logdir, "--json", str(summary_path)],
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    scalars, texts, plugins = read_events(logdir)
    total = summary["steps"] + summary["warmup_steps"]
    assert total == 8
    for tag in STEP_TAGS:
        assert sorted(scalars[tag]) == list(range(1, total + 1)), tag
        assert plugins[tag] == "scalars"
    for step in range(1, total + 1):
        wait, compute = scalars["step/wait_ms"][step], scalars["step/compute_ms"][step]
        assert wait >= 0 and compute > 0
        assert scalars["step/ms"][step] == pytest.approx(wait + compute, rel=1e-5)
        assert 0 <= scalars["step/queue_batches"][step] <= summary["queue_capacity"]
    assert scalars["step/loss"][1] == pytest.approx(summary["loss_first"], rel=1e-4)
    if summary["loss_last"] is None:  # the seed's AlexNet diverges on batches of 2
        assert math.isnan(scalars["step/loss"][total])
    else:
        assert scalars["step/loss"][total] == pytest.approx(summary["loss_last"], rel=1e-4)

    # Window figures: written at the last step of each window, the final one at the end.
    assert max(scalars["input/stall_pct"]) == total
    for stall in scalars["input/stall_pct"].values():
        assert 0 <= stall <= 100
    for queued in scalars["queue/batches"].values():
        assert 0 <= queued <= summary["queue_capacity"]
    assert all(v > 0 for v in scalars["throughput/examples_per_s"].values())
    assert all(v > 0 for v in scalars["input/consume_batches_per_s"].values())
    assert set(scalars["producers/seen"].values()) == {1.0}
    (producer,) = summary["producers"]
    assert f"producers/batches_per_s/{producer}" in scalars
    assert scalars["drops/total"][total] == 0
    assert all(
        math.isfinite(v)
        for tag, series in scalars.items()
        if tag != "step/loss"  # NaN once the seed's AlexNet diverged (batches of 2)
        for v in series.values()
    )
    assert texts == {"advice": summary["advice"]}
    assert plugins["advice"] == "text"


def test_an_unusable_logdir_fails_at_start(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monitor = Monitor(ObserveOptions(logdir=str(blocker / "tb")))
    with pytest.raises(ConfigError, match="cannot write TensorBoard logs to .*file/tb"):
        monitor.start(FACTS, RunReader(lambda: 0, Ledger().read))
    monitor.close()


def test_close_writes_pending_steps_and_joins_the_thread(tmp_path) -> None:
    counters, reader = StepCounters(FACTS.queue_capacity), RunReader(lambda: 0, Ledger().read)
    writer = TensorBoardWriter(
        str(tmp_path),
        lambda: take_snapshot(counters, reader),
        lambda a, b: figures_between(a, b, FACTS),
        interval_s=60,
    ).start()
    assert any(t.name == "stagefeed-tensorboard" for t in threading.enumerate())
    for step in (1, 2, 3):
        record = StepRecord(step, True, 0.01 * step, 0.1, 7.0 - step, step, 0.0)
        counters.add(record)
        writer.record(record)
    writer.close("balanced: test")
    writer.close()  # idempotent
    assert not any(t.name == "stagefeed-tensorboard" for t in threading.enumerate())
    scalars, texts, _ = read_events(str(tmp_path))
    assert scalars["step/wait_ms"] == {1: pytest.approx(10), 2: pytest.approx(20), 3: 30}
    assert scalars["step/loss"] == {1: 6.0, 2: 5.0, 3: 4.0}
    assert scalars["input/stall_pct"][3] == pytest.approx(100 * 0.06 / 0.36, rel=1e-5)
    assert texts == {"advice": "balanced: test"}
