"""``stagefeed bench ingest`` and its peers (raw pyzmq, memcpy) at tiny sizes: sane figures.

No timing is asserted: each figure must be positive and finite and the counts must add up.
"""

from __future__ import annotations

import json
import math

import pytest

from stagefeed.bench.rawzmq import measure_memcpy, measure_raw
from stagefeed.bench.sources import labels_in_place
from stagefeed.common.schema import check_arrays, image_schema
from stagefeed.producer.buffers import allocate_batch
from stagefeed.producer.sources import WorkerInfo
from tests.conftest import run_cli

TINY_SCHEMA = image_schema(batch_size=2, dtype="uint8")


def test_memcpy_copies_one_batch_of_images():
    result = measure_memcpy(TINY_SCHEMA, repeats=3)
    assert result["bytes"] == 2 * 227 * 227 * 3
    assert result["repeats"] == 3
    assert math.isfinite(result["gb_per_s"]) and result["gb_per_s"] > 0
    assert result["best_gb_per_s"] >= result["gb_per_s"]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_raw_pyzmq_counts_every_timed_byte(transport):
    result = measure_raw(TINY_SCHEMA, senders=2, transport=transport, count=6)
    assert result["messages"] == 6
    assert result["bytes"] == 6 * TINY_SCHEMA.batch_bytes
    assert result["warmup_messages"] >= 2 + 2 * 2  # each sender heard from, then 2 x senders
    assert math.isfinite(result["gb_per_s"]) and result["gb_per_s"] > 0


@pytest.mark.slow
def test_ingest_reports_stagefeed_next_to_raw(tmp_path):
    path = tmp_path / "ingest.json"
    flags = "--dtypes uint8,float32 --producers 2 --transports ipc --batch-size 2 --gb 0.005"
    done = run_cli(
        ["bench", "ingest", *flags.split(), "--repeats", "2", "--json", str(path)], timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with open(path) as f:
        report = json.load(f)
    assert [(r["dtype"], r["producers"], r["transport"]) for r in report["runs"]] == [
        ("uint8", 2, "ipc"),
        ("float32", 2, "ipc"),
    ]
    for run in report["runs"]:
        schema = image_schema(batch_size=2, dtype=run["dtype"])
        count = run["batches_per_measurement"]
        assert len(run["raw"]["samples"]) == len(run["stagefeed"]["samples"]) == 2
        for raw, fed in zip(run["raw"]["samples"], run["stagefeed"]["samples"], strict=True):
            assert raw["messages"] == fed["batches"] == count >= 3
            assert fed["bytes"] == raw["bytes"] == count * schema.batch_bytes
            assert fed["dropped"] == 0
            assert fed["received"] >= fed["warmup_batches"] + count
        for peer in (run["raw"], run["stagefeed"]):
            rates = sorted(s["gb_per_s"] for s in peer["samples"])
            assert all(math.isfinite(r) and r > 0 for r in rates)
            assert peer["gb_per_s"] == pytest.approx(sum(rates) / 2, abs=0.001)  # the median
        assert run["ratio"] == pytest.approx(
            run["stagefeed"]["gb_per_s"] / run["raw"]["gb_per_s"], rel=0.01
        )
        assert run["memcpy"]["gb_per_s"] > 0 and len(run["memcpy"]["samples"]) == 2
        assert f"| {run['dtype']} |" in done.stdout
    # The peers are measured in alternating order so neither always goes first.
    assert [r["raw_first"] for r in report["runs"]] == [True, False]


@pytest.mark.process  # the trivial model is a Keras model: TensorFlow
def test_trivial_model_gets_the_batch_uncast_and_the_wire_is_unchanged():
    """A cast in the schema would convert every whole uint8 batch before the trivial model
    reads one pixel; the delivery schema drops it and moves the same bytes and messages."""
    from stagefeed.bench.ingest import delivery_schema, trivial_model_fn
    from stagefeed.consumer.graph.feed_graph import build

    schema = delivery_schema(TINY_SCHEMA)
    assert schema["images"].cast is None and schema["images"].scale is None
    assert schema.wire() == TINY_SCHEMA.wire() and schema.batch_bytes == TINY_SCHEMA.batch_bytes
    feed = build(schema, 2, 1, "/cpu:0", trivial_model_fn)
    whole = list(schema.batch_shape(schema["images"]))
    casts = [op for op in feed.graph.get_operations() if op.type == "Cast"]
    assert casts and all(op.outputs[0].shape.as_list() != whole for op in casts)


@pytest.mark.parametrize(("flag", "value"), [("--transports", "udp"), ("--shm-fills", "mmap")])
def test_bad_ingest_flags_name_the_value(flag, value):
    done = run_cli(["bench", "ingest", flag, value, "--log-level", "info"], timeout=60)
    assert done.returncode == 2
    assert value in done.stderr and "Traceback" not in done.stderr
    assert "TensorFlow" not in done.stderr  # refused before it loads (it logs when it has)


@pytest.mark.slow
def test_ingest_measures_shared_memory_copied_and_in_place_next_to_raw_tcp(tmp_path):
    path = tmp_path / "ingest.json"
    flags = "--dtypes uint8 --producers 2 --transports shm --batch-size 2 --gb 0.005"
    done = run_cli(
        ["bench", "ingest", *flags.split(), "--repeats", "1", "--json", str(path)], timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = json.loads(path.read_text())["runs"]
    assert [run["fill"] for run in runs] == ["copy", "inplace"]
    for run in runs:
        assert run["transport"] == "shm" and run["raw_transport"] == "tcp"
        (fed,) = run["stagefeed"]["samples"]
        assert fed["shm"]["pools_accepted"] == 2 and fed["dropped"] == 0
        assert fed["shm"]["batches"] == fed["received"] >= fed["warmup_batches"] + fed["batches"]
        for peer in (run["stagefeed"], run["raw"]):
            assert peer["core_ms_per_batch"] is not None and peer["core_ms_per_batch"] >= 0
    assert "| uint8 | 0.31 | shm | 2 |" in done.stdout and "(tcp)" in done.stdout
    assert "| uint8 | 0.31 | shm in place | 2 |" in done.stdout


def test_labels_in_place_writes_labels_within_bounds_and_nothing_else():
    schema = image_schema(batch_size=4, image_size=3, dtype="uint8", num_classes=3)
    source = labels_in_place(schema, WorkerInfo(index=1, count=2, producer_id="p", seed=0))
    out = allocate_batch(schema)
    out["images"][...] = 9
    seen = set()
    for _ in range(3):
        assert source.fill(out) is True
        check_arrays(schema, out, "labels_in_place")
        seen.update(out["labels"].tolist())
    assert seen == {0, 1, 2} and (out["images"] == 9).all()
