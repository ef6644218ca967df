"""``stagefeed.Producers``, the public producer object: start / wait / close, the context
manager, each worker's books from its own report, nothing left running after ``close()``, and
no TensorFlow in the process that uses it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import psutil
import pytest

import stagefeed
from stagefeed.common.options import ProducerOptions
from stagefeed.common.schema import ArraySpec, Schema
from tests.conftest import REPO, cli_env, wait_for
from tests.helpers import procs
from tests.helpers.standin_trainer import StandInTrainer

SMALL = Schema((ArraySpec("x", "float32", (16,)), ArraySpec("y", "int32")), batch_size=4)


def _children() -> list[str]:
    """This process's children, but multiprocessing's resource tracker (started once per
    process and kept: ``Producers.start`` makes sure it runs before any worker)."""
    running = [p.cmdline() for p in psutil.Process().children(recursive=True) if p.is_running()]
    return [" ".join(c) for c in running if "resource_tracker" not in " ".join(c)]


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_a_source_error_is_raised_by_wait_and_booked_per_worker():
    source = "tests.helpers.user_source:wrong_dtype_at_3"
    message = f"source '{source}' batch 3: x is float64[4, 16], expected float32[4, 16]"
    with StandInTrainer(SMALL, credit=2, regrant=True) as trainer:
        options = ProducerOptions(connect=trainer.endpoint, schema=SMALL, workers=2, source=source)
        with stagefeed.Producers(options) as producers:
            with pytest.raises(stagefeed.ConfigError) as info:
                producers.wait(60)
            assert wait_for(lambda: producers.alive() == 0, 60)  # the other one ends too
        assert wait_for(lambda: len(trainer.byes) == 2, 5)
    assert str(info.value) == message
    books = producers.books()
    assert [(b.worker, b.state, b.exit_code, b.sent, b.bye, b.error) for b in books] == [
        (0, "failed", 2, 3, "source_error", message),
        (1, "failed", 2, 3, "source_error", message),
    ]
    assert sorted(r.seq for r in trainer.received) == [0, 0, 1, 1, 2, 2]
    assert not any(p.is_alive() for p in producers.processes)


def test_close_stops_endless_workers_joins_them_and_is_idempotent():
    shm_before = _shm()
    with StandInTrainer(SMALL, credit=2, regrant=True, drop={1: "value_range"}) as trainer:
        options = ProducerOptions(connect=trainer.endpoint, schema=SMALL, workers=2, rate=50.0)
        producers = stagefeed.Producers(options, log_level=30).start()
        assert [b.state for b in producers.books()] == ["running", "running"]
        assert wait_for(lambda: len(trainer.received) >= 6, 60), trainer.received
        assert producers.wait(0.2) is False  # endless: still running at the deadline
        assert producers.alive() == 2
        producers.close()
        producers.close()  # idempotent
        received = len(trainer.received)
    assert producers.alive() == 0 and not _children()
    assert [p.exitcode for p in producers.processes] == [0, 0]
    books = producers.books()
    assert [b.state for b in books] == ["stopped", "stopped"]
    assert all(b.bye is None and b.error == "" for b in books)
    # What each worker handed over covers what the trainer got (a stop discards the rest).
    assert sum(b.sent for b in books) >= received + 2  # + the two batches it refused
    assert sorted(b.refused.get("value_range", 0) for b in books) == [1, 1]
    assert _shm() == shm_before
    assert producers.wait(0) is True  # nothing failed: a stop is no failure
    with pytest.raises(stagefeed.ClosedError):
        producers.start()
    assert "closed" in repr(producers)


def test_start_twice_is_refused_and_options_are_checked():
    with pytest.raises(TypeError, match="ProducerOptions"):
        stagefeed.Producers({"connect": "tcp://127.0.0.1:1"})  # type: ignore[arg-type]
    options = ProducerOptions(connect="tcp://127.0.0.1:9", curve_keys="/nonexistent/keys")
    with pytest.raises(stagefeed.ConfigError, match="/nonexistent/keys"):
        stagefeed.Producers(options).start()


# A user's script: stagefeed.Producers against a real trainer, in a fresh interpreter.
SCRIPT = """
import dataclasses, json, sys
import stagefeed

options = stagefeed.ProducerOptions(
    connect=sys.argv[1], workers=2, max_batches=3, schema=stagefeed.image_schema(batch_size=2)
)
with stagefeed.Producers(options) as producers:
    ended = producers.wait(120)
print(json.dumps({
    "ended": ended,
    "alive": producers.alive(),
    "books": [dataclasses.asdict(b) for b in producers.books()],
    "tensorflow": "tensorflow" in sys.modules or "keras" in sys.modules,
}))
"""


@pytest.mark.slow  # starts TensorFlow in the trainer's process
def test_producers_feed_a_real_trainer_from_a_script_without_tensorflow(spawn):
    trainer = procs.Trainer(spawn)  # --steps 0: it ends once the producers' data has ended
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, trainer.endpoint],
        capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=180, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["tensorflow"] is False
    assert result["ended"] is True and result["alive"] == 0
    books = [stagefeed.WorkerBook(**b) for b in result["books"]]
    assert [(b.worker, b.state, b.exit_code, b.sent, dict(b.refused), b.bye) for b in books] == [
        (0, "finished", 0, 3, {}, "ok"),
        (1, "finished", 0, 3, {}, "ok"),
    ]
    assert trainer.started.wait(120) == 0, procs.log_text(trainer.started)
    with open(trainer.json_path) as f:
        summary = json.load(f)
    assert summary["batches"]["received"] == 6 and summary["batches"]["trained"] == 6
    assert summary["producers_ended"] == {"ok": 2}
    assert dataclasses.asdict(books[0])["name"] == "stagefeed-producer-0"


def test_a_report_fits_one_atomic_pipe_write_and_junk_is_ignored():
    import multiprocessing

    from stagefeed.producer.process_pipes import MAX_REPORT_BYTES, WorkerReports

    reports = WorkerReports(multiprocessing.get_context("spawn"))
    writer = reports._writer  # what a worker holds
    writer.send_bytes(b"\x80not json")
    writer.send_bytes(b'{"worker": "0"}')
    reports.report(0, 2, "failed", 3, {"value_range": 1}, "source_error", "é\n" * 10_000)
    reports.read()
    report = reports.of(0)
    assert report is not None and report["sent"] == 3 and report["refused"] == {"value_range": 1}
    assert 0 < len(report["error"]) < 10_000 * 2
    assert len(json.dumps(report).encode()) <= MAX_REPORT_BYTES
    assert isinstance(reports.first(), stagefeed.ConfigError)
