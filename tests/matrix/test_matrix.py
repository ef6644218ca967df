"""The promise matrix's cells (``tests/matrix/grid.py``): each scenario runs on each column it
names, as a user runs that path (the real CLI or a user's program on the public API, real
producer processes, signals sent from outside), and checks every row it covers. A scenario
goes on after a row fails, so one run reports every broken promise of its column at once.

``make test-matrix`` runs them (``.ci/run`` calls it after ``make test``).
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.matrix import data, grid
from tests.matrix.paths import (
    TIMEOUT_S,
    PathRun,
    family_pids,
    leftovers,
    max_gap_s,
    wait_gone,
)

pytestmark = pytest.mark.slow

# docs/guarantees.md, "Signals and shutdown": ended within 5 s of the signal, plus the step in
# progress (at most FAST_STEP_S here). tests/test_signals.py holds the CLI to that (+0.5 s);
# here two cells start TensorFlow processes at once on two cores (measured: up to 11.2 s in
# a fresh clone's make test-matrix), so the slack is 10 s.
STOP_WITHIN_S = 5.0 + data.FAST_STEP_S + 10.0
# The waiting line's interval (TrainerOptions.wait_log_s, 10 s) and the progress lines' (2 s
# here), plus slack: no longer silence is allowed from TensorFlow's import to the end.
LIVENESS_S = 13.0


class Promises:
    """The failures of one scenario, by row: a scenario checks on after a failed row."""

    def __init__(self, column: grid.Column) -> None:
        self.column = column
        self.failed: list[str] = []

    def check(self, row: str, ok: bool, detail: str) -> bool:
        assert row in grid.PROMISES, row
        if grid.reason_for(row, self.column) is None and not ok:
            self.failed.append(f"[{row}] {self.column.id}: {detail}")
        return ok

    def assert_held(self) -> None:
        assert not self.failed, "\n\n".join(self.failed)


def _tail(text: str) -> str:
    return text[-2500:]


def _stop_round(run: PathRun, p: Promises, row: str, first: bool) -> None:
    """A round stopped by the row's signal once a checkpoint was written."""
    sig = {"stop_sigint": signal.SIGINT, "stop_sigterm": signal.SIGTERM}[row]
    if grid.reason_for(row, run.column) is not None:
        sig = signal.SIGKILL  # SIGTERM's default in a user's program: a kill
    separate = run.column.path not in ("graph_run", "keras_run")
    run.start(row, producers_after_s=LIVENESS_S + 2 if first and separate else 0.0)
    run.wait_checkpoint()
    trainer_pids = [pid for proc in run.trainers for pid in family_pids_of(proc)]
    sent = run.signal(sig)
    codes = run.wait_trainers()
    gone = wait_gone(trainer_pids, 10)
    took = time.monotonic() - sent
    for index in range(len(run.trainers)):
        log = run.log(index)
        p.check(row, codes[index] == (0 if sig != signal.SIGKILL else -9),
                f"trainer {index} exit {codes[index]}\n{_tail(log)}")
        p.check(row, "Traceback" not in log, f"a traceback in trainer {index}\n{_tail(log)}")
        if run.column.path.startswith("feed_"):
            p.check(row, sig == signal.SIGKILL or "interrupted" in log,
                    f"trainer {index}: no 'interrupted' line\n{_tail(log)}")
        else:
            p.check(row, "stagefeed summary" in log and "interrupted" in log,
                    f"trainer {index}: no interrupted summary\n{_tail(log)}")
        gap = max_gap_s(log)
        p.check("liveness", gap <= LIVENESS_S, f"{gap:.0f} s without a line\n{_tail(log)}")
    p.check(row, took <= STOP_WITHIN_S, f"stopping took {took:.1f} s > {STOP_WITHIN_S} s")
    if sig != signal.SIGKILL:
        left = leftovers(trainer_pids) if gone else [f"processes {trainer_pids}"]
        p.check("nothing_left", not left, f"after {row}: {left}")
    if run.column.path == "feed_fit":  # no position: every round is a new run
        run.stop_all()
        run.producers = []


def family_pids_of(proc) -> list[int]:
    from tests.helpers import procs

    try:
        return [member.pid for member in procs.family(proc)]
    except Exception:  # noqa: BLE001 (it ended: its pid is all there is)
        return [proc.proc.pid]


@pytest.mark.parametrize("column", grid.columns_of("chain"), ids=lambda c: c.id)
def test_chain(column: grid.Column, tmp_path) -> None:
    run = PathRun(column, tmp_path)
    p = Promises(column)
    try:
        _chain(run, p)
    finally:
        run.stop_all()
    p.assert_held()


def _chain(run: PathRun, p: Promises) -> None:
    column = run.column
    _stop_round(run, p, "stop_sigint", first=True)
    _stop_round(run, p, "stop_sigterm", first=False)
    # Killed at a checkpoint: what it leaves must be gone once the next run has started.
    run.start("killed")
    run.wait_checkpoint()
    killed = [pid for proc in run.trainers for pid in family_pids_of(proc)]
    run.kill()
    if column.path == "feed_fit":
        run.stop_all()
        run.producers = []
    # To the end of the data with more producers (elastic: the checkpoint of 2 shards dealt
    # out to 3; a cluster's to 4, two a worker).
    elastic = grid.reason_for("exactly_once_elastic", column) is None
    if elastic:
        run.kill_producers()
        run.producer_count = 4 if column.path == "cluster" else 3
    run.start("last")
    codes = run.wait_trainers()
    logs = [run.log(i) for i in range(len(run.trainers))]
    for index, log in enumerate(logs):
        p.check("exactly_once", codes[index] == 0, f"exit {codes[index]}\n{_tail(log)}")
        gap = max_gap_s(log)
        p.check("liveness", gap <= LIVENESS_S, f"{gap:.0f} s without a line\n{_tail(log)}")
    left = leftovers(killed)
    p.check("nothing_left", not left, f"after kill -9 and a new start: {left}")
    try:
        counts = run.counts()
    except (OSError, ValueError) as e:
        p.check("exactly_once", False, f"no counts: {e}\n{_tail(logs[0])}")
        counts = None
    if counts is not None:
        wrong = data.miscounted(counts)
        for row in ("exactly_once", "exactly_once_across_kill", "exactly_once_elastic"):
            p.check(row, not wrong, f"rows not trained {data.PASSES} times: {_few(wrong)}")
    if elastic:
        shards = run.producer_count
        p.check("exactly_once_elastic",
                all(f"position of 2 shards is dealt out to {shards}" in log for log in logs),
                f"the checkpoint was not dealt out to {shards} shards\n{_tail(logs[0])}")
        p.check("length_follows_passes", not wrong or counts.min() > 0,
                f"rows never trained: {_few(wrong)}")
    if not column.path.startswith("feed_"):
        for index in range(len(run.trainers)):
            _check_length(run, p, index)
    for proc in run.producers:
        try:
            code = proc.wait(60)
        except Exception:  # noqa: BLE001 (still running: the check says so)
            code = None
        p.check("nothing_left", code == 0,
                f"producer {proc.log_path.name} after the end: exit {code}\n"
                f"{_tail(proc.output())}")
    everyone = family_pids(run)
    p.check("nothing_left", wait_gone(everyone, 15) and not leftovers(everyone),
            f"after the end: {leftovers(everyone)}")
    if grid.reason_for("finished_refused", column) is None:
        _run_again(run, p, counts)


def _check_length(run: PathRun, p: Promises, index: int) -> None:
    try:
        summary = run.summary(index)
    except (OSError, ValueError) as e:
        p.check("length_follows_passes", False, f"no JSON summary: {e}")
        return
    workers = len(run.trainers)
    planned = data.total_batches() // workers
    resumed = summary.get("resumed_from") or 0
    length = summary.get("run_length") or {}
    p.check("length_follows_passes", summary.get("steps", 0) + resumed == planned,
            f"worker {index}: steps {summary.get('steps')} + resumed {resumed} != {planned}")
    epochs = (length.get("planned_epochs"), length.get("epochs_done"))
    p.check("length_follows_passes", epochs == (data.PASSES, data.PASSES),
            f"worker {index}: run_length {length}")


def _run_again(run: PathRun, p: Promises, counts) -> None:
    """The finished run started again: refused in one line, exit 2 (the CLI, and a loop's
    ServedFeed resumed from its final position)."""
    run.start("again")
    codes = run.wait_trainers()
    for index, code in enumerate(codes):
        log = run.log(index)
        last = [line for line in log.strip().splitlines() if line][-1:]
        if index > 0:  # a cluster's other worker: its chief refused, so it never joins one
            p.check("finished_refused", code == 3 and "the cluster did not form" in log,
                    f"worker {index}: exit {code}\n{_tail(log)}")
        else:
            p.check("finished_refused", code == 2 and "finished" in "".join(last),
                    f"worker {index}: exit {code}, last line {last}\n{_tail(log)}")
        p.check("finished_refused", "Traceback" not in log, _tail(log))
    if counts is not None:
        again = run.counts()
        p.check("finished_refused", (again == counts).all(), "the counts changed")
    run.stop_all()


def _few(wrong: dict) -> str:
    items = sorted(wrong.items())
    return f"{len(items)} rows, e.g. {items[:8]}"


@pytest.mark.parametrize("column", grid.columns_of("bad_source"), ids=lambda c: c.id)
def test_bad_source(column: grid.Column, tmp_path) -> None:
    """``run`` ends by itself (exit 3 after its summary); a trainer fed by separate producers
    trains what they delivered and waits for the shards they never sent (a user restarts
    them), so it is stopped with SIGINT once the failure reached it."""
    run = PathRun(column, tmp_path)
    p = Promises(column)
    try:
        run.start("bad-source", source="failing")
        for proc in run.producers:
            code = proc.wait(TIMEOUT_S)
            text = proc.output().strip().splitlines()
            p.check("bad_source", code == 3 and "fails at batch" in text[-1],
                    f"producer exit {code}, last line {text[-1:]}")
        if run.producers:
            p.check("bad_source", run.wait_line(r"source_error"), _tail(run.log()))
            run.signal(signal.SIGINT)
        codes = run.wait_trainers()
        for index in range(len(run.trainers)):
            log = run.log(index)
            p.check("bad_source", "Traceback" not in log, _tail(log))
            p.check("bad_source", "source_error" in log, f"no source_error\n{_tail(log)}")
            if run.producers:
                p.check("bad_source", codes[index] == 0, f"exit {codes[index]}\n{_tail(log)}")
                continue
            last = log.strip().splitlines()[-1]
            p.check("bad_source", codes[index] == 3, f"exit {codes[index]}\n{_tail(log)}")
            p.check("bad_source", "fails at batch" in last, f"last line {last!r}")
        if not column.path.startswith("feed_"):
            for index in range(len(run.trainers)):
                books = run.summary(index)["batches"]
                # run trains them all; a trainer stopped while it waits for the shards never
                # sent holds the rest (queued, or buffered by fit): a resume trains them.
                held = 0 if not run.producers else books["queued_at_stop"] + books["abandoned"]
                p.check("bad_source", books["trained"] + held == books["received"] > 0
                        and not books["dropped"] and not books["seq_missing"],
                        f"worker {index}: {books}: a delivered batch is missing")
    finally:
        run.stop_all()
    p.assert_held()


BAD_MODELS = {"graph_run": "tests.matrix.data:graph_wrong_labels"}


@pytest.mark.parametrize("column", grid.columns_of("bad_model"), ids=lambda c: c.id)
def test_bad_model(column: grid.Column, tmp_path) -> None:
    run = PathRun(column, tmp_path)
    p = Promises(column)
    try:
        if column.path == "feed_fit":
            run.trainers = [run._start(
                ["--mode", "fit", "--bind", run.feeds[0], "--save", str(run.save),
                 "--model", "wrong"], "trainer")]  # fmt: skip
        else:
            run.start("bad-model", model=BAD_MODELS.get(column.path,
                                                        "tests.matrix.data:keras_wrong_output"))
        codes = run.wait_trainers()
        for index, code in enumerate(codes):
            log = run.log(index)
            last = log.strip().splitlines()[-1]
            if column.path == "feed_fit":
                p.check("bad_model", re.match(r"stagefeed\.\S*Error: ", last) is not None,
                        f"exit {code}, last line {last!r}\n{_tail(log)}")
                continue
            p.check("bad_model", code == 2, f"exit {code}\n{_tail(log)}")
            p.check("bad_model", "Traceback" not in log, _tail(log))
            p.check("bad_model", "wrong" in last, f"last line {last!r}")
    finally:
        run.stop_all()
    p.assert_held()

