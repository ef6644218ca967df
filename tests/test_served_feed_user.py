"""A user's program on the public API (``tests/matrix/feed_user.py``, what docs/tf2.md tells a
user to write), run as a user runs it: its own process, the signal sent from outside.

- Ctrl-C while ``fit`` or a ``for`` loop waits for data that never comes (no producer) ends
  the program: the feed's queue closes (consumer/tf2/feed_signals.py), the wait returns and
  the ``KeyboardInterrupt`` leaves the ``with`` block, which closes the feed.
- ``feed.callback()`` checks the model at ``fit``'s start: a model that cannot train on the
  feed fails with one ``stagefeed.ConfigError`` before any batch (no producer needed).
- A loop resumed from the position of a finished run (every pass trained) is refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, cli_env, free_tcp_port
from tests.matrix import data

pytestmark = pytest.mark.slow

START_S = 180  # TensorFlow's import and the first trace on a loaded 2-core box
# docs/tf2.md: SIGINT ends the wait at once; the slack is for a loaded box (measured: ~1 s).
STOP_WITHIN_S = 10.0


class UserProgram:
    """``python -m tests.matrix.feed_user ARGS`` in its own session, its output in a file."""

    def __init__(self, tmp_path, *args: str) -> None:
        self.log_path = tmp_path / "user.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed by stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.matrix.feed_user", "--bind",
             f"tcp://127.0.0.1:{free_tcp_port()}", "--save", str(tmp_path / "save"), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=cli_env(), cwd=REPO,
            start_new_session=True,
        )  # fmt: skip

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if text in self.output():
                return True
            time.sleep(0.2)
        return text in self.output()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._log.close()


@pytest.fixture
def user(tmp_path):
    started: list[UserProgram] = []

    def start(*args: str) -> UserProgram:
        program = UserProgram(tmp_path, *args)
        started.append(program)
        return program

    yield start
    for program in started:
        program.stop()


@pytest.mark.parametrize("mode", ["loop", "fit"])
def test_ctrl_c_ends_a_program_waiting_for_data_that_never_comes(user, mode):
    """Before: no producer, the main thread in TensorFlow's dequeue: SIGINT set CPython's flag
    and nothing ran it; the program waited until killed."""
    program = user("--mode", mode)
    assert program.wait_for("listening on", START_S), program.output()[-3000:]
    time.sleep(8)  # the dataset built, its first dequeue waiting (no producer)
    assert program.proc.poll() is None, program.output()[-3000:]
    sent = time.monotonic()
    os.kill(program.proc.pid, signal.SIGINT)
    try:
        code = program.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - sent
    text = program.output()
    assert code == 0, text[-3000:]
    assert took <= STOP_WITHIN_S, f"{took:.1f} s\n{text[-3000:]}"
    assert "SIGINT: the feed's queue closes" in text
    assert "interrupted: the feed is closed" in text  # the with block was left, closing it
    assert "Traceback" not in text, text[-3000:]


def test_fit_refuses_a_model_that_cannot_train_on_the_feed_before_any_batch(user):
    """Before: the callback did not check the model; with no producer ``fit`` waited for the
    first batch for ever, and with one it failed there with TensorFlow's ValueError."""
    program = user("--mode", "fit", "--model", "wrong")
    try:
        code = program.proc.wait(START_S)
    except subprocess.TimeoutExpired:
        code = None
    text = program.output()
    last = text.strip().splitlines()[-1]
    assert code == 1 and last.startswith("stagefeed.common.errors.ConfigError: model "
                                         "'wrong_output'"), text[-3000:]  # fmt: skip
    assert "fit ended" not in text, text[-3000:]  # the callback's first call refused it


def test_a_loop_resumed_from_a_finished_position_is_refused_in_one_line(user, tmp_path):
    """Before: a loop's final position (every pass of ``TrainerOptions(epochs=2)`` trained)
    given back as ``resume`` made a feed that trained pass 3 once producers came (here, with
    none, it waited for ever)."""
    save = tmp_path / "save"
    save.mkdir()
    final = {"version": 1, "shards": 1, "approximate": [],
             "streams": {"0": {"next": 10, "above": [], "end": 10, "passes": [5, 10]}}}
    # The program's checkpoint (tests/matrix/feed_user.py): the counts file it names, then
    # the position.
    np.save(save / "counts-1-10.npy", np.zeros(data.ROWS, np.float32))
    (save / "position.json").write_text(json.dumps({"counts": "counts-1-10.npy",
                                                    "position": final}))
    assert data.PASSES == 2
    program = user("--mode", "loop")
    try:
        code = program.proc.wait(START_S)
    except subprocess.TimeoutExpired:
        code = None
    text = program.output()
    last = text.strip().splitlines()[-1]
    assert code == 2, text[-3000:]
    assert "the position holds a finished run" in last and "nothing to resume" in last, last
    assert "TrainerOptions(epochs=2)" in last and "Traceback" not in text, text[-3000:]
