"""SIGINT and SIGTERM to ``stagefeed run``, ``train`` and ``produce``, once or repeatedly, at
start-up, while working and during the shutdown: the command ends within its bound, exits 0
without a traceback, prints its summary (run, train), and leaves nothing behind (process, ipc
socket file, shared-memory file).

SIGTERM goes to the command's process only (``kill``, ``docker stop``); SIGINT goes to its
whole process group, as a terminal's Ctrl-C does. "Nothing left" is checked on the process
group (every process stagefeed starts stays in it, the resource tracker included, so one that
started late or was orphaned is found too) and on /dev/shm: no file that the run's processes
mapped before the signal may remain (the producers' stop flag and failure reports are pipes
now, so there is none to map: ``test_run`` checks that). Other sessions on the machine create
and leak files there of their own, so "appeared during the run" would not say whose they
are: what a process of the run maps does.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading
import time

import psutil
import pytest
import zmq

from stagefeed.common import protocol
from stagefeed.common.schema import image_schema
from tests.conftest import TINY, free_tcp_port, wait_for
from tests.helpers import procs

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess

# The promise (README, Shutdown): stopped within 5 s of the first signal, once a TensorFlow
# import or a train step in progress has finished. Both of those take as long as the machine
# makes them take, so the bound starts after the import (the trainer logs when it ends) and
# adds the slowest train step the run itself logged: the same promise on any machine, at any
# load.
STOP_WITHIN_S = 5.0
TF_LOADED = r"TensorFlow \S+ loaded in"
STEP_MS = re.compile(r"step \d+/\S+\s+(\d+) ms/step")
STARTUP_S = 120
BURST = [signal.SIGINT, signal.SIGTERM, signal.SIGINT]  # a user pressing Ctrl-C, then kill
BURST_GAP_S = 0.3


def _send(started, sig: int) -> None:
    try:
        if sig == signal.SIGINT:
            os.killpg(started.proc.pid, sig)
        else:
            os.kill(started.proc.pid, sig)
    except ProcessLookupError:
        pass  # it already ended: a later signal of a burst has nobody to reach


def _group(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


class Watch:
    """What a test knows about a command before signalling it: its family, ipc files, sems."""

    def __init__(self, started, files: list[str] = ()) -> None:
        self.started = started
        self.pgid = started.proc.pid
        self.family = procs.family(started)
        self.shm = procs.shm_paths(self.family)
        self.files = list(files)
        self.first_signal_at: float | None = None

    def send(self, sigs: list[int], gap_s: float = BURST_GAP_S) -> None:
        for i, sig in enumerate(sigs):
            if i:
                time.sleep(gap_s)
            if self.first_signal_at is None:
                self.first_signal_at = time.monotonic()
            _send(self.started, sig)

    def check_ended(self, summary: bool, after_import: bool = False) -> str:
        """All of the run is gone within ``STOP_WITHIN_S`` of the first signal (of the end of
        TensorFlow's import, if ``after_import`` and that came later), plus the slowest train
        step the run logged; returns the log."""
        assert self.first_signal_at is not None
        loaded_at = None if after_import else self.first_signal_at

        def ended() -> bool:
            nonlocal loaded_at
            if loaded_at is None and re.search(TF_LOADED, procs.log_text(self.started)):
                loaded_at = time.monotonic()
            return not _group(self.pgid) and self.started.proc.poll() is not None

        gone = wait_for(ended, 90, interval=0.05)
        ended_at = time.monotonic()
        log = procs.log_text(self.started)
        assert gone, ([p.cmdline() for p in _group(self.pgid)], log[-3000:])
        assert loaded_at is not None, f"TensorFlow's import never ended\n{log[-3000:]}"
        step_s = max((int(ms) for ms in STEP_MS.findall(log)), default=0) / 1000
        took = ended_at - max(self.first_signal_at, loaded_at)
        bound = STOP_WITHIN_S + step_s + 0.5
        assert took <= bound, f"stopping took {took:.1f} s > {bound:.1f} s\n{log[-3000:]}"
        assert not [p for p in self.family if procs._alive(p)]
        assert self.started.wait(1) == 0, log[-3000:]
        assert "Traceback" not in log, log
        assert "KeyboardInterrupt" not in log, log
        if summary:
            assert "stagefeed summary" in log and "interrupted" in log, log[-3000:]
        left = [path for path in [*self.files, *self.shm] if os.path.exists(path)]
        assert not left, left
        return log


def _workers_alive(started) -> int:
    try:
        parent = psutil.Process(started.proc.pid)
        # Spawned workers, not the resource tracker (tests.helpers.procs.workers_of says why).
        return sum("--multiprocessing-fork" in c.cmdline() for c in parent.children())
    except psutil.Error:
        return 0


def _tensorflow_loading(started) -> bool:
    """True once the process maps a TensorFlow library: it is importing TensorFlow (or past it)."""
    try:
        maps = psutil.Process(started.proc.pid).memory_maps(grouped=True)
    except psutil.Error:
        return False
    return any("tensorflow" in m.path for m in maps)


# ``run`` on the tiny regression (tests/helpers/regression_models.py): the signal path is the same
# as
# with AlexNet, at a fraction of the CPU; rate-limited producers keep the queue fed.
REGRESSION_SCHEMA = ["--schema", "tests.helpers.regression_models:SCHEMA"]
REGRESSION_SOURCE = ["--source", "tests.helpers.regression_models:sums", "--rate", "20"]


def _model(name: str) -> list[str]:
    return ["--model", f"tests.helpers.regression_models:{name}"]


def _run(spawn, model: str = "linear_fn"):
    flags = [*REGRESSION_SCHEMA, *_model(model), *REGRESSION_SOURCE]
    started = spawn(
        ["run", *flags, "--transport", "ipc", "--producers", "2", "--steps", "0"]
        + ["--queue-mb", "1", "--progress-s", "1"],
        name="run",
    )
    socket_file = os.path.join(tempfile.gettempdir(), f"stagefeed-{started.proc.pid}.sock")
    return started, socket_file


# ---- one signal while working (the original cases) -------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_run(spawn, sig):
    started, socket_file = _run(spawn)
    assert procs.wait_log(started, "staging area primed", STARTUP_S), procs.log_text(started)
    procs.workers_of(started, 2)
    assert os.path.exists(socket_file)
    watch = Watch(started, [socket_file])
    assert watch.shm == set(), watch.shm  # no named semaphore, nothing else in /dev/shm
    watch.send([sig])
    watch.check_ended(summary=True)


@pytest.fixture(scope="module")
def ipc_producer(tmp_path_factory):
    """An unthrottled producer pushing to an ipc socket that the train tests bind in turn."""
    spawner = procs.Spawner(tmp_path_factory.mktemp("signals"))
    socket_file = str(spawner.folder / "trainer.sock")
    spawner(["produce", "--connect", f"ipc://{socket_file}", *TINY, "--inflight-mb", "8"])
    yield socket_file
    spawner.kill_all()


def _train(spawn, socket_file):
    return spawn(["train", "--bind", f"ipc://{socket_file}", *procs.TRAINER_FLAGS], name="train")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_train_while_its_enqueues_wait_on_a_full_queue(spawn, ipc_producer, sig):
    started = _train(spawn, ipc_producer)
    # An unthrottled producer keeps the 3-batch queue full: enqueue threads wait in enqueue.
    assert procs.wait_log(started, "staging area primed", STARTUP_S), procs.log_text(started)
    watch = Watch(started, [ipc_producer])
    assert os.path.exists(ipc_producer)
    watch.send([sig])
    watch.check_ended(summary=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_produce_while_it_cannot_reach_the_trainer(spawn, sig):
    nobody = f"tcp://127.0.0.1:{free_tcp_port()}"
    started = spawn(["produce", "--connect", nobody, "--workers", "2", *TINY], name="produce")
    procs.workers_of(started, 2)

    def said_twice() -> bool:
        return procs.log_text(started).count("cannot reach the trainer") >= 2

    assert wait_for(said_twice, 60), procs.log_text(started)
    watch = Watch(started)
    watch.send([sig])
    log = watch.check_ended(summary=False)
    assert log.count("cannot reach the trainer") == 2  # once per worker


# ---- repeated signals: at start-up, while working, during the shutdown ------------------------


def test_run_signalled_repeatedly_while_tensorflow_starts(spawn):
    started, socket_file = _run(spawn)
    assert wait_for(lambda: _tensorflow_loading(started), STARTUP_S), procs.log_text(started)
    watch = Watch(started, [socket_file])
    watch.send(BURST)
    log = watch.check_ended(summary=True, after_import=True)
    assert "producers ->" not in log  # nothing that had not started yet was started


def test_run_signalled_repeatedly_while_training(spawn):
    started, socket_file = _run(spawn)
    assert procs.wait_log(started, r"step \d+", STARTUP_S), procs.log_text(started)
    procs.workers_of(started, 2)
    watch = Watch(started, [socket_file])
    watch.send(BURST)
    watch.check_ended(summary=True)


# The later signals follow the first closely, while the step in progress still runs: every step
# of ``slow_linear_fn`` sleeps 2 s, so they land while the command is stopping at any load (with
# a fast step, a loaded machine once let ``train`` end before the second signal came). They
# make the shutdown urgent.
AGAIN = [signal.SIGTERM, signal.SIGINT, signal.SIGTERM]
AGAIN_GAP_S = 0.05


def test_run_signalled_again_while_it_stops(spawn):
    started, socket_file = _run(spawn, model="slow_linear_fn")
    assert procs.wait_log(started, r"step \d+", STARTUP_S), procs.log_text(started)
    procs.workers_of(started, 2)
    watch = Watch(started, [socket_file])
    watch.send(AGAIN, gap_s=AGAIN_GAP_S)
    log = watch.check_ended(summary=True)
    assert "SIGTERM received: stopping" in log
    assert "received while stopping: shutting down without grace periods" in log


def test_train_signalled_again_while_it_stops(spawn, tmp_path):
    socket_file = str(tmp_path / "trainer.sock")
    address = f"ipc://{socket_file}"
    spawn(["produce", "--connect", address, *REGRESSION_SCHEMA, *REGRESSION_SOURCE], name="produce")
    started = spawn(
        ["train", "--bind", address, *REGRESSION_SCHEMA, *_model("slow_linear_fn"), "--steps", "0"]
        + ["--progress-s", "1"],
        name="train",
    )
    assert procs.wait_log(started, r"step \d+", STARTUP_S), procs.log_text(started)
    watch = Watch(started, [socket_file])
    watch.send(AGAIN, gap_s=AGAIN_GAP_S)
    log = watch.check_ended(summary=True)
    assert "received while stopping: shutting down without grace periods" in log


def test_train_signalled_repeatedly_while_tensorflow_starts(spawn, ipc_producer):
    started = _train(spawn, ipc_producer)
    assert wait_for(lambda: _tensorflow_loading(started), STARTUP_S), procs.log_text(started)
    watch = Watch(started)
    watch.send(BURST)
    watch.check_ended(summary=True, after_import=True)


def test_train_signalled_repeatedly_while_training(spawn, ipc_producer):
    started = _train(spawn, ipc_producer)
    assert procs.wait_log(started, r"step \d+", STARTUP_S), procs.log_text(started)
    watch = Watch(started, [ipc_producer])
    watch.send(BURST)
    watch.check_ended(summary=True)


def test_produce_signalled_repeatedly_while_its_workers_start(spawn):
    nobody = f"tcp://127.0.0.1:{free_tcp_port()}"
    started = spawn(["produce", "--connect", nobody, "--workers", "2", *TINY], name="produce")
    # The first worker exists: the workers are being spawned or import their modules, before
    # their own handlers are in place.
    assert wait_for(lambda: _workers_alive(started) >= 1, 60, interval=0.01)
    watch = Watch(started)
    watch.send(BURST, gap_s=0.1)
    watch.check_ended(summary=False)


def test_produce_signalled_repeatedly_while_it_cannot_reach_the_trainer(spawn):
    nobody = f"tcp://127.0.0.1:{free_tcp_port()}"
    started = spawn(["produce", "--connect", nobody, "--workers", "2", *TINY], name="produce")
    procs.workers_of(started, 2)
    assert procs.wait_log(started, "cannot reach the trainer", 60), procs.log_text(started)
    watch = Watch(started)
    watch.send(BURST)
    watch.check_ended(summary=False)


@pytest.fixture
def deaf_trainer():
    """A ROUTER that welcomes two producers with plenty of credit, then never reads again:
    finished producers linger, unable to deliver. Both are welcomed once both said hello, so
    no batch is ever read (one welcomed first could deliver all of its batches while the
    other's hello was awaited, and then not linger)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 64 * 1024)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def welcome_two() -> None:
        said_hello: list[bytes] = []
        while len(said_hello) < 2 and not stop.is_set():
            if not sock.poll(100):
                continue
            routing_id, raw, *_ = sock.recv_multipart()
            hello = protocol.decode_header(raw, protocol.FROM_PRODUCER)["t"] == "hello"
            if hello and routing_id not in said_hello:  # a producer may say it again
                said_hello.append(routing_id)
        welcome = protocol.encode_control(
            "welcome", schema=image_schema(batch_size=2).to_dict(), max_message=2**24,
            credit=100,
        )  # fmt: skip
        for routing_id in said_hello:
            sock.send_multipart([routing_id, welcome])

    thread = threading.Thread(target=welcome_two, name="deaf-trainer")
    thread.start()
    yield f"tcp://127.0.0.1:{port}"
    stop.set()
    thread.join(5)
    sock.close(linger=0)
    ctx.term()


@pytest.mark.parametrize("sigs", [[signal.SIGTERM], BURST], ids=["once", "repeatedly"])
def test_produce_signalled_while_its_workers_linger_to_deliver(spawn, deaf_trainer, sigs):
    """Workers that reached --max-batches wait up to 30 s for ZeroMQ to deliver; a stop
    request discards the rest instead, so the command still ends within the bound."""
    started = spawn(
        ["produce", "--connect", deaf_trainer, "--workers", "2", *TINY, "--max-batches", "40"],
        name="produce",
    )

    def both_lingering() -> bool:
        return procs.log_text(started).count("delivering the last") >= 2

    assert wait_for(both_lingering, 60), procs.log_text(started)
    watch = Watch(started)
    watch.send(sigs)
    log = watch.check_ended(summary=False)
    if len(sigs) == 1:  # a second signal may end a worker before it says so
        assert log.count("stop requested while delivering the last batches") == 2, log
