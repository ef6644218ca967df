"""``stagefeed bench steps``: every mode runs for real at tiny sizes and yields sane figures.

No timing is asserted: only that each figure exists, is positive and finite, and that the
counts add up (steps asked = steps timed, one wait per step where waits are measured).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time

import psutil
import pytest

from stagefeed.bench.config import KERAS_MODES, STEP_MODES, StepsConfig, expand_modes
from stagefeed.bench.cpu import TreeCpu, process_cpu_s, threads_cpu_s, tree_cpu_s
from stagefeed.bench.report import machine
from stagefeed.bench.steps import summarize
from stagefeed.bench.table import steps_table
from stagefeed.common.errors import BrokenError, ClosedError
from stagefeed.producer.pool import WorkerBook, pool_check
from tests.conftest import run_cli, wait_for

pytestmark = pytest.mark.slow

# 195x195, the smallest image AlexNet takes: ten mode workers' AlexNets at 227 cost ~10 s more
# of CPU in a suite that is CPU-bound.
TINY_STEPS = ["--batch-size", "2", "--steps", "4", "--rounds", "2", "--warmup-steps", "1",
              "--image-size", "195"]  # fmt: skip


def _bench(tmp_path, modes: list[str], *extra: str) -> tuple[dict, str]:
    path = tmp_path / "steps.json"
    args = ["bench", "steps", "--modes", ",".join(modes), *TINY_STEPS, "--queue-mb", "16"]
    done = run_cli([*args, "--json", str(path), *extra], timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    # Workers end without Python's finalization (bench.worker): nothing may be left behind.
    assert "leaked" not in done.stderr and "terminating" not in done.stderr, done.stderr
    with open(path) as f:
        return json.load(f), done.stdout


def _check_figures(figures: dict, steps: int, batch_size: int) -> None:
    assert figures["steps"] == steps == len(figures["step_ms"])
    assert all(math.isfinite(ms) and ms > 0 for ms in figures["step_ms"])
    assert 0 < figures["p10_ms"] <= figures["median_ms"] <= figures["p90_ms"]
    mean_s = sum(figures["step_ms"]) / steps / 1000
    assert figures["images_per_s"] == pytest.approx(batch_size / mean_s, rel=0.01)


def _table_rows(table: str, heading: str) -> list[str]:
    """The mode names of the table under ``heading`` in the printed report."""
    block = table.split(heading, 1)[1].split("\n\n", 2)[1]
    return [line.split(" | ")[0].lstrip("| ") for line in block.splitlines()[2:]]


def test_every_mode_of_both_families_yields_figures_and_its_ratio_in_one_run(tmp_path):
    """Every mode, graph (the seed's table) and Keras (its own), interleaved in one run (one
    run, not one per mode or family: each mode starts a TensorFlow worker): its figures, and
    ratio = its median / its family's reference's (synthetic-device, keras-synthetic), paired
    ratio = the median of its steps over the reference's of the same turn. uint8 over shared
    memory from one producer: batches of both dtypes are made (float32:
    ``test_sigterm_mid_run_stops_every_process``), and the cast layer's path runs."""
    modes = list(STEP_MODES + KERAS_MODES)
    assert modes[0] == "synthetic-device"
    extra = ("--producers", "1", "--dtype", "uint8", "--transport", "shm")
    report, table = _bench(tmp_path, ["all"], *extra)
    assert list(report["modes"]) == modes
    # Two rounds: forward, then reversed.
    assert report["order"] == [modes, modes[::-1]]
    assert report["device"] == "/cpu:0"
    assert report["settings"]["transport"] == "shm"
    for name, figures in report["modes"].items():
        _check_figures(figures, 4, 2)
        reference = report["modes"][figures["reference"]]
        assert figures["reference"] == ("keras-synthetic" if name in KERAS_MODES
                                        else "synthetic-device")  # fmt: skip
        assert figures["ratio"] == pytest.approx(
            figures["median_ms"] / reference["median_ms"], 0.01), name  # fmt: skip
        pairs = sorted(s / r for s, r in zip(figures["step_ms"], reference["step_ms"], strict=True))
        assert figures["paired_ratio"] == pytest.approx((pairs[1] + pairs[2]) / 2, 0.01), name
        assert f"| {name} |" in table
    for name in ("synthetic-device", "keras-synthetic"):
        assert report["modes"][name]["ratio"] == report["modes"][name]["paired_ratio"] == 1.0
    # Graph mode: the stall is stagefeed's alone (it waits outside session.run).
    stagefeed, seed = report["modes"]["stagefeed"], report["modes"]["seed-staging"]
    assert len(stagefeed["wait_ms"]) == 4
    assert all(w >= 0 for w in stagefeed["wait_ms"])
    assert 0 <= stagefeed["stall_pct"] <= 100
    assert stagefeed["info"]["producers"] == 1
    assert seed["stall_pct"] is None and seed["wait_ms"] is None
    assert seed["info"]["queue_capacity"] == report["settings"]["queue_capacity"]
    # Warm-up block + 2 timed blocks, each followed by a settle that refilled the queue.
    assert [s["queue_full"] for s in seed["settle"]] == [True, True, True]
    # The Keras trio: the wait is inside Keras' train_function, so no stall figure.
    for name in KERAS_MODES:
        figures = report["modes"][name]
        assert figures["family"] == "keras" and figures["stall_pct"] is None
        assert figures["info"]["parameters"] == (
            report["modes"]["keras-synthetic"]["info"]["parameters"])  # fmt: skip
    keras_stagefeed = report["modes"]["keras-stagefeed"]
    assert keras_stagefeed["feed_cpu_ms_per_step"] >= 0
    assert keras_stagefeed["info"]["producers"] == 1
    assert keras_stagefeed["info"]["queue_full_at_start"] is True
    assert [s["queue_full"] for s in keras_stagefeed["settle"]] == [True, True, True]
    assert _table_rows(table, "AlexNet (graph mode") == list(STEP_MODES)
    assert _table_rows(table, "AlexNet in Keras 3") == list(KERAS_MODES)
    assert "| mode | median ms/step | p10 | p90 | images/s | x keras-synthetic |" in table
    assert "staging depth 2, shm." in table


def test_modes_without_their_reference_get_no_ratio():
    """Graph modes timed without synthetic-device beside them: no ratio is made up, and the
    table says n/a (``bench.steps.summarize`` on figures of a run, no process started)."""
    config = StepsConfig(modes=("stagefeed", "seed-staging"), steps=4, warmup_steps=1,
                         rounds=2)  # fmt: skip
    timed = {
        name: {"step_s": [0.1, 0.12, 0.11, 0.13], "wait_s": [0.0] * 4 if name == "stagefeed"
               else [None] * 4, "process_cpu_s": [0.1] * 4, "feed_cpu_s": [0.01] * 4}
        for name in config.modes
    }  # fmt: skip
    order = [list(config.modes), list(reversed(config.modes))]
    settles = {name: [] for name in config.modes}
    report = summarize(config, machine(), {}, timed, settles, order)
    for name in config.modes:
        assert report["modes"][name]["reference"] == "synthetic-device"
        assert report["modes"][name]["ratio"] is None
        assert report["modes"][name]["paired_ratio"] is None
    assert report["modes"]["stagefeed"]["stall_pct"] == 0.0
    assert report["modes"]["seed-staging"]["stall_pct"] is None
    assert "n/a" in steps_table(report)


def test_families_expand_to_their_modes():
    assert expand_modes(("keras",)) == KERAS_MODES
    assert expand_modes(("graph",)) == STEP_MODES
    assert expand_modes(("all",)) == STEP_MODES + KERAS_MODES
    assert expand_modes(("keras-stagefeed", "keras", "stagefeed")) == (
        "keras-stagefeed", "keras-synthetic", "keras-from_generator", "stagefeed",
    )  # fmt: skip
    assert StepsConfig().modes == STEP_MODES


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--modes", "synthetic-device,bogus"], "bogus"),
        (["--modes", "keras,kerass"], "kerass"),
        (["--image-size", "100"], "100x100"),
        (["--rounds", "9", "--steps", "4"], "rounds=9"),
    ],
)
def test_bad_flags_fail_before_anything_starts(flags, named):
    done = run_cli(["bench", "steps", *flags], timeout=60)
    assert done.returncode == 2
    assert named in done.stderr
    assert "ready" not in done.stderr


def _group_members(pgid: int) -> list[int]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def test_sigterm_mid_run_stops_every_process(start_cli):
    """SIGTERM to the bench alone: its mode workers and their producers all end in seconds."""
    flags = "--modes stagefeed,synthetic-device --batch-size 2 --steps 100000 --rounds 2"
    flags += " --image-size 195"
    bench = start_cli(["bench", "steps", *flags.split(), "--log-level", "info"], name="bench")
    assert wait_for(lambda: "mode synthetic-device ready" in bench.output(), 120)
    pgid = bench.proc.pid
    assert len(_group_members(pgid)) >= 4  # bench, 2 workers, a producer at least
    bench.signal(signal.SIGTERM)
    assert bench.wait(20) == 130, bench.output()
    assert wait_for(lambda: not _group_members(pgid), 15), _group_members(pgid)
    assert "stopped before it finished" in bench.output()


def test_blocks_split_the_timed_steps_into_rounds():
    assert StepsConfig(steps=5).blocks() == [1, 1, 1, 1, 1]  # default: one step per block
    assert StepsConfig(steps=5, rounds=2).blocks() == [3, 2]
    assert StepsConfig(steps=5, rounds=5).round_count == 5


class _Pool:
    """What ``pool_check`` reads of a ``Producers``: live processes, and ``wait`` raising
    for a failed one."""

    def __init__(self, alive: int, failed: str = "", books: list | None = None) -> None:
        self.live, self.failed, self._books = alive, failed, books or []

    def alive(self) -> int:
        return self.live

    def books(self) -> list[WorkerBook]:
        return self._books

    def wait(self, timeout_s: float | None = None) -> bool:
        if self.failed:
            raise BrokenError(f"producer processes failed: {self.failed}")
        return self.live == 0


def test_pool_check_passes_while_any_producer_lives():
    pool_check(_Pool(alive=1))()
    pool_check(_Pool(alive=2), ClosedError)()


def test_a_source_that_failed_after_its_end_ends_the_intake_while_the_others_live():
    # Another worker may wait for the failed shard's pass end: the run drains and fails now.
    failed = WorkerBook(1, "stagefeed-producer-1", "failed", 2, bye="source_error", error="bad")
    running = WorkerBook(0, "stagefeed-producer-0", "running", None)
    with pytest.raises(ClosedError, match="stagefeed-producer-1's source failed"):
        pool_check(_Pool(alive=1, books=[running, failed]), ClosedError)()
    # Died without its end (killed): the others go on, as before.
    killed = WorkerBook(1, "stagefeed-producer-1", "killed", -9)
    pool_check(_Pool(alive=1, books=[running, killed]), ClosedError)()


def test_pool_check_says_how_the_producers_ended():
    with pytest.raises(BrokenError, match="all producers ended"):
        pool_check(_Pool(alive=0))()
    with pytest.raises(ClosedError, match="all producers ended"):
        pool_check(_Pool(alive=0), ClosedError)()
    # A failure is a failure even where a clean end is not one (the launcher's ClosedError).
    with pytest.raises(BrokenError, match="stagefeed-producer-0 \\(exit 3\\)"):
        pool_check(_Pool(alive=0, failed="stagefeed-producer-0 (exit 3)"), ClosedError)()


def test_cpu_seconds_of_a_process_and_of_named_threads():
    release = threading.Event()

    def spin() -> None:
        while time.thread_time() < 0.2:
            pass
        release.wait(30)

    thread = threading.Thread(target=spin, name="bench-test-spin")
    thread.start()
    deadline = time.monotonic() + 30
    try:
        while (threads_cpu_s(("bench-test-spin",)) or 0.0) < 0.15:
            assert time.monotonic() < deadline, "the spinning thread got no CPU time"
            time.sleep(0.02)
        assert threads_cpu_s(("bench-test-spin",)) >= 0.15
        assert threads_cpu_s(("no-such-thread",)) == 0.0
    finally:
        release.set()
        thread.join()
    assert process_cpu_s() >= 0.15
    assert process_cpu_s(2**22 + 1) is None  # above Linux's pid_max: no such process


def test_a_tree_read_often_is_listed_again_only_after_its_interval():
    """``TreeCpu`` (``bench input`` reads it at every progress line): a child started after a
    listing counts from the next listing, and then with all its CPU, like ``tree_cpu_s``."""
    import subprocess
    import sys

    spin = "import time\nwhile time.process_time() < 0.4: pass\ntime.sleep(60)"
    reader = TreeCpu(os.getpid(), relist_s=2.0)
    before = reader()
    listed_at = reader.listed_at
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        assert wait_for(lambda: (process_cpu_s(child.pid) or 0.0) >= 0.3, 30)
        unlisted = reader()
        if reader.listed_at == listed_at:  # not listed again yet: the child is not counted
            assert unlisted - before < 0.3
        time.sleep(max(0.0, listed_at + 2.0 - time.monotonic()))
        assert reader() - before >= 0.3 and reader.listed_at > listed_at
        assert tree_cpu_s() - before >= 0.3
    finally:
        child.kill()
        child.wait()
    assert TreeCpu(2**22 + 1)() is None  # above Linux's pid_max: no such process
