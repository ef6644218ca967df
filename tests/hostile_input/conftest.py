"""The fixtures of the hostile-input tests: one trainer for the whole package (``target``) and a
fresh hostile connection per test (``peer``); and the order of the package's last tests."""

from __future__ import annotations

import pathlib
from collections.abc import Generator

import pytest
import zmq

from tests.conftest import REPO, TINY
from tests.helpers import procs
from tests.hostile.good_producer import start_good_producer
from tests.hostile_input.harness import MAX_MESSAGE_MB, Target, new_peer, say_end, trained_total

GOOD_RATE = "4"  # batches/s: at least what the trainer takes, so its queue stays full
PACKAGE = pathlib.Path(__file__).parent  # as pytest names its items' paths: not resolved
MANY_FRAMES = "test_message_of_many_frames_each_under_max_message_mb"
SUMMARY = "test_summary_books_every_case"
# Run after every other test of the package, in this order, whatever the files are called. The
# many-frames test leaves the trainer holding what libzmq allocated for its 96 MiB message
# (glibc keeps it, trim off), so it comes after every test that measures the trainer's memory;
# the summary stops the trainer and checks the books of every test before it, so it comes last.
RUN_LAST = (MANY_FRAMES, SUMMARY)
# The files run in this order (as the cases did in the one module they came from). The size
# and flood cases measure what one message costs the trainer, so they come before the hello
# flood, whose hundreds of connections leave libzmq's memory fragmented: after it, the
# 200k-frame message once raised the trainer's RSS by 10.7-27.9 MiB, before it by 9.8-9.9.
FILE_ORDER = (
    "test_framing_and_headers.py",
    "test_arrays.py",
    "test_credit_and_sequence.py",
    "test_sizes_and_floods.py",
    "test_hello_and_schema.py",
    "test_summary.py",
)


def _metrics_label_flags() -> list[str]:
    """Per-producer metric labels may become opt-in (``--metrics-producer-labels``)."""
    text = (pathlib.Path(REPO) / "stagefeed" / "cli.py").read_text()
    return ["--metrics-producer-labels"] if "metrics-producer-labels" in text else []


@pytest.fixture(scope="package")
def target(tmp_path_factory):
    """The one trainer of the package, training on a good producer: started by the package's
    first test that needs it, stopped right after the package's last test."""
    spawn = procs.Spawner(tmp_path_factory.mktemp("hostile"))
    ctx = zmq.Context()
    try:
        trainer = procs.Trainer(
            spawn, "--max-message-mb", str(MAX_MESSAGE_MB), *_metrics_label_flags()
        )
        good = start_good_producer(spawn, trainer.endpoint, GOOD_RATE, tiny=TINY)
        steady = trainer.wait_metrics(lambda m: trained_total(m) >= 4, 120)
        assert trained_total(steady) >= 4, procs.log_text(trainer.started) + procs.log_text(good)
        assert len(steady.trained) <= 1, steady.trained
        label = next(iter(steady.trained), None)
        peak = procs.PeakRss(trainer)
        steady_peak = peak.settled()
        yield Target(trainer, label, good, ctx, steady_peak, peak, steady_peak)
    finally:
        spawn.kill_all()
        ctx.destroy(linger=0)


@pytest.fixture
def peer(target):
    """A fresh hostile DEALER that said hello (so it has books and credit); ``end`` after."""
    p = new_peer(target)
    yield p
    say_end(target, p)


def _ours(item: pytest.Item) -> bool:
    return item.path.is_relative_to(PACKAGE)


def _name(item: pytest.Item) -> str:
    return getattr(item, "originalname", item.name)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Generator[None, None, None]:
    """Run the package's files in ``FILE_ORDER`` and the ``RUN_LAST`` tests after the others;
    skip a summary with nothing to sum.

    A wrapper called first, so this runs last: after ``-k``, ``-m``, ``--deselect`` and
    ``--lf`` chose the items and ``--ff``/``--nf`` reordered them. The session's items are
    all of the suite's: the package's run together, where the first of them was, so one
    trainer serves them all and is stopped right after the last; the others keep their order.
    Run without any other test of the package that uses the trainer, the summary would check
    empty books: it is skipped, saying why, rather than pass vacuously.
    """
    ours = [item for item in items if _ours(item)]
    files = {path.name for path in PACKAGE.glob("test_*.py")}
    if files != set(FILE_ORDER):
        raise pytest.UsageError(f"{__file__}: FILE_ORDER is not the package's files {files}")
    if {item.path.name for item in ours} == files:  # the whole package
        missing = set(RUN_LAST) - {_name(item) for item in ours}
        if missing:
            raise pytest.UsageError(f"{__file__}: RUN_LAST names no test: {sorted(missing)}")
    result = yield
    ours = [item for item in items if _ours(item)]
    if not ours:
        return result
    at = items.index(ours[0])
    ours.sort(key=lambda item: FILE_ORDER.index(item.path.name))  # stable: in-file order kept
    first = [item for item in ours if _name(item) not in RUN_LAST]
    last = sorted(
        (item for item in ours if _name(item) in RUN_LAST), key=lambda t: RUN_LAST.index(_name(t))
    )
    rest = [item for item in items if not _ours(item)]
    items[:] = rest[:at] + first + last + rest[at:]
    for summary in (item for item in last if _name(item) == SUMMARY):
        if not any("target" in item.fixturenames for item in ours if item is not summary):
            summary.add_marker(
                pytest.mark.skip(
                    reason="it checks the books of the package's other tests on the trainer, "
                    "and none of them is selected"
                )
            )
    return result
