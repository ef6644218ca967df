"""SIGINT and SIGTERM to ``stagefeed run``, ``train`` and ``produce``: everything stops within
5 seconds and nothing is left behind (process, ipc socket file, shared-memory file).

SIGTERM goes to the command's process only (``kill``, ``docker stop``); SIGINT goes to its
whole process group, as a terminal's Ctrl-C does. Processes are listed with psutil before the
signal: the command, every descendant (producer workers, multiprocessing's helpers) and
anything else in its process group; shared memory is what those processes map or hold open
under /dev/shm.
"""

from __future__ import annotations

import os
import signal
import tempfile

import pytest

from tests import procs
from tests.conftest import TINY, free_tcp_port, wait_for

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

STOP_WITHIN_S = 5.0
STARTUP_S = 120


@pytest.fixture
def spawn(tmp_path):
    spawner = procs.Spawner(tmp_path)
    yield spawner
    spawner.kill_all()


def _send(started, sig: int) -> None:
    if sig == signal.SIGINT:
        os.killpg(started.proc.pid, sig)
    else:
        os.kill(started.proc.pid, sig)


def _stop_and_check(started, sig: int, files: list[str]) -> None:
    """Signal; every process of the family is gone within 5 s; no file is left behind."""
    family = procs.family(started)
    shm = procs.shm_paths(family)
    for path in files:
        assert os.path.exists(path), f"{path} should exist while running"
    _send(started, sig)
    gone, took = procs.gone_within(family, 30)
    assert gone, [p.cmdline() for p in family if p.is_running()]
    assert took <= STOP_WITHIN_S, f"stopping took {took:.1f} s"
    assert started.wait(1) == 0, procs.log_text(started)
    left = [p for p in [*files, *shm] if os.path.exists(p)]
    assert not left, left
    assert "Traceback" not in procs.log_text(started)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_run(spawn, sig):
    started = spawn(
        ["run", *TINY, "--transport", "ipc", "--producers", "2", "--steps", "0"]
        + ["--queue-mb", "4", "--progress-s", "1"],
        name="run",
    )
    assert procs.wait_log(started, "staging area primed", STARTUP_S), procs.log_text(started)
    procs.workers_of(started, 2)
    socket_file = os.path.join(tempfile.gettempdir(), f"stagefeed-{started.proc.pid}.sock")
    _stop_and_check(started, sig, [socket_file])
    assert "interrupted" in procs.log_text(started)


@pytest.fixture(scope="module")
def ipc_producer(tmp_path_factory):
    """An unthrottled producer pushing to an ipc socket that the train tests bind in turn."""
    spawner = procs.Spawner(tmp_path_factory.mktemp("signals"))
    socket_file = str(spawner.folder / "trainer.sock")
    spawner(["produce", "--connect", f"ipc://{socket_file}", *TINY, "--inflight-mb", "8"])
    yield socket_file
    spawner.kill_all()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_train_while_its_enqueues_wait_on_a_full_queue(spawn, ipc_producer, sig):
    started = spawn(
        ["train", "--bind", f"ipc://{ipc_producer}", *procs.TRAINER_FLAGS], name="train"
    )
    # An unthrottled producer keeps the 3-batch queue full: receive threads wait in enqueue.
    assert procs.wait_log(started, "staging area primed", STARTUP_S), procs.log_text(started)
    _stop_and_check(started, sig, [ipc_producer])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_produce_while_it_cannot_reach_the_trainer(spawn, sig):
    nobody = f"tcp://127.0.0.1:{free_tcp_port()}"
    started = spawn(["produce", "--connect", nobody, "--workers", "2", *TINY], name="produce")
    procs.workers_of(started, 2)

    def said_twice() -> bool:
        return procs.log_text(started).count("cannot reach the trainer") >= 2

    assert wait_for(said_twice, 60), procs.log_text(started)
    _stop_and_check(started, sig, [])
    assert procs.log_text(started).count("cannot reach the trainer") == 2  # once per worker
