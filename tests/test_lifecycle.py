"""The shutdown machinery in-process: real signals to this process, real producer processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.lifecycle import URGENT_S, Shutdown, on_stop_signals, stop_processes
from stagefeed.common.options import ProducerOptions
from stagefeed.common.schema import image_schema
from stagefeed.producer.pool import Producers
from tests.conftest import free_tcp_port, wait_for

SPEC = image_schema(batch_size=2, image_size=8, num_classes=10)
SIGNAL_WAIT_S = 10.0


@pytest.fixture
def shutdown():
    installed = Shutdown().install()
    yield installed
    installed.restore()


def test_first_signal_stops_a_later_one_hurries_none_raises(shutdown):
    os.kill(os.getpid(), signal.SIGINT)  # would be a KeyboardInterrupt without the Shutdown
    assert shutdown.stop.wait(5), "no stop within 5 s of SIGINT"
    assert shutdown.by_signal and not shutdown.urgent.is_set()
    assert shutdown.grace(4.0) == 4.0
    os.kill(os.getpid(), signal.SIGTERM)  # would end the test run
    assert shutdown.urgent.wait(5), "no hurry within 5 s of a second signal"
    assert shutdown.grace(4.0) == URGENT_S
    for _ in range(5):
        os.kill(os.getpid(), signal.SIGINT)
    assert wait_for(lambda: shutdown.received == 7, 5), (
        f"{shutdown.received} of 7 signals seen in 5 s"
    )


def test_a_signal_while_the_command_ends_by_itself_hurries_and_is_no_interruption(shutdown):
    shutdown.begin()  # steps done: the command is closing
    os.kill(os.getpid(), signal.SIGTERM)
    assert shutdown.urgent.wait(5), "no hurry within 5 s of SIGTERM while closing"
    assert not shutdown.by_signal


def test_restore_puts_the_handlers_back_and_joins_its_thread():
    # From Python's defaults: a ServedFeed made earlier in this worker process and left open
    # keeps its own SIGINT handler (consumer/tf2/feed_signals.py), which raises nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    installed = Shutdown().install()
    assert any(t.name == "stagefeed-signals" for t in threading.enumerate())
    installed.restore()
    installed.restore()  # idempotent
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert not any(t.name == "stagefeed-signals" for t in threading.enumerate())
    with pytest.raises(KeyboardInterrupt):  # the default behaviour is back
        os.kill(os.getpid(), signal.SIGINT)
        # Python runs the handler in the main thread at its next check: wait for it.
        deadline = time.monotonic() + SIGNAL_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.01)
        pytest.fail(f"no KeyboardInterrupt within {SIGNAL_WAIT_S} s of SIGINT after restore()")


def test_finish_ignores_later_signals():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    installed = Shutdown().install()
    try:
        installed.finish()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: this process lives on
        # A signal whose action is SIG_IGN is discarded when it is sent (POSIX), so it has
        # had its chance once kill() returned: none is left pending to act later.
        assert signal.SIGTERM not in signal.sigpending()
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def test_on_stop_signals_calls_the_handlers_in_turn():
    calls: list[tuple[str, int]] = []
    restore = on_stop_signals(
        lambda sig: calls.append(("stop", sig)), lambda sig: calls.append(("urgent", sig))
    )
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(lambda: len(calls) == 1, 5), f"handlers called {calls} within 5 s"
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: len(calls) == 2, 5), f"handlers called {calls} within 5 s"
    finally:
        restore()
    assert calls == [("stop", signal.SIGTERM), ("urgent", signal.SIGINT)]


def ignore_sigterm_and_sleep(ready) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(60)


def test_stop_processes_kills_a_process_ignoring_sigterm_and_hurry_cuts_the_join():
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=ignore_sigterm_and_sleep, args=(ready,), name="stubborn", daemon=True)
    proc.start()
    assert ready.wait(30), "the stubborn process did not start within 30 s"
    hurry = threading.Event()
    threading.Timer(0.3, hurry.set).start()
    began = time.monotonic()
    forced = stop_processes([proc], timeout_s=60, hurry=hurry.is_set)
    assert forced == [proc]
    assert proc.exitcode == -signal.SIGKILL
    assert time.monotonic() - began < 30  # hurried: the 60 s join was cut short


def _pool(source: str = "synthetic") -> Producers:
    options = ProducerOptions(
        connect=f"tcp://127.0.0.1:{free_tcp_port()}",  # nobody listens
        workers=2,
        schema=SPEC,
        source=source,
        inflight_mb=1,
    )
    return Producers(options).start()


def test_workers_stopped_by_the_flag_are_no_failure():
    pool = _pool()
    try:
        assert wait_for(lambda: pool.alive() == 2, 30), (
            f"{pool.alive()} of 2 workers alive after 30 s"
        )
    finally:
        pool.close()
    assert [p.exitcode for p in pool.processes] == [0, 0]
    assert pool.failures() == []
    assert pool.wait(0)


def test_a_worker_that_failed_is_reported_even_after_close():
    pool = _pool("tests.no_such_module:batches")  # the source cannot load: the worker exits 2
    try:
        assert wait_for(lambda: pool.alive() == 0, 60), (
            f"{pool.alive()} workers still alive after 60 s"
        )
    finally:
        pool.close()  # sets the stop flag: the failures happened before, and still count
    assert sorted(pool.failures()) == [
        "stagefeed-producer-0 (exit 2)",
        "stagefeed-producer-1 (exit 2)",
    ]
    with pytest.raises(ConfigError, match="no_such_module"):  # the worker's own line
        pool.wait(0)
