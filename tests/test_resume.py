"""Resume exactly (docs/resume.md): runs killed with SIGKILL mid-epoch, re-run with the same
command until they finish; every row is then trained exactly ``EPOCHS`` times.

The model's only state is a per-row counter (``tests/helpers/resume_models.py``): the final
checkpoint's ``row_counts`` is ``EPOCHS`` for every row only if every batch whose effect is in
each checkpoint was never trained again, and every batch that was not (queued, staged, in
flight when the process died) was trained after the resume, once. A position saved before
its model, or one counting the queued tail as trained, leaves counts of 1 or 3 here.

Real processes: ``stagefeed run`` (its whole process group killed), ``stagefeed train`` killed
alone while ``stagefeed produce`` keeps running (its producers rewind when the new trainer
welcomes them, also those that had finished: they stay until a checkpoint holds their whole
shard), and a kill between a checkpoint's model and its state file (the test hook
``STAGEFEED_TEST_STATE_DELAY_S``).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import cli_env, free_tcp_port, wait_for
from tests.helpers.procs import log_text, wait_log
from tests.helpers.resume_models import ROWS, counts_in, miscounted, stream

MODEL = [
    "--schema", "tests.helpers.resume_models:SCHEMA", "--model",
        "tests.helpers.resume_models:row_counter",
    "--steps", "0", "--warmup-steps", "0", "--checkpoint-every", "5", "--progress-s", "100",
    "--producer-timeout-s", "4",
]  # fmt: skip
SOURCE = ["--source", "tests.helpers.resume_models:rows", "--rate", "10"]
STEPS = 2 * len(stream(0, 2))  # two shards, every pass: 48 steps in all
TIMEOUT_S = 120


def _run(save) -> list[str]:
    return ["run", "--producers", "2", *MODEL, *SOURCE, "--save", str(save)]


def _killed_at(spawn, args: list[str], pattern: str, name: str, env=None):
    """Start ``args``, SIGKILL its whole process group once ``pattern`` is in its log."""
    started = spawn(args, name) if env is None else _spawn_env(spawn, args, name, env)
    assert wait_log(started, pattern, TIMEOUT_S), log_text(started)[-3000:]
    started.kill_group()
    return started


def _last_checkpoint(started) -> int:
    """The step of the newest checkpoint the killed run logged as written (the kill may land a
    few steps after the pattern it waited for, on a loaded machine): where the next run resumes
    at the least (``_resumed``)."""
    return max(int(n) for n in re.findall(r"step (\d+): checkpoint", log_text(started)))


def _resumed(text: str, at_least: int) -> int:
    """The step the run that logged ``text`` resumed from: the killed run's newest logged
    checkpoint ``at_least``, or a later one. A SIGKILL can land after a checkpoint's state file
    is in place but before its line reaches the log (seen beside a CPU hog: resumed from 20,
    the log's last was 15)."""
    found = re.search(r"state-(\d{6})\.json: step (\d+)", text)
    assert found and int(found.group(1)) == int(found.group(2)), text[-3000:]
    step = int(found.group(2))
    assert step >= at_least and step % 5 == 0, (step, at_least)  # --checkpoint-every 5
    return step


def _spawn_env(spawn, args, name, env):
    from tests.conftest import Started

    started = Started(args, env=env, log_path=spawn.folder / f"{name}-{len(spawn.started)}.log")
    spawn.started.append(started)
    return started


def _finished(started) -> str:
    assert started.wait(TIMEOUT_S) == 0, log_text(started)[-4000:]
    return log_text(started)


def _check_every_row_trained_exactly_epochs_times(save) -> None:
    counts = counts_in(str(save / "model.ckpt"))
    assert counts.shape == (ROWS,)
    assert not miscounted(counts), miscounted(counts)
    with open(save / "state.json") as f:
        state = json.load(f)
    assert state["step"] == STEPS and state["finished"] == "every producer's data ended"
    ends = {s: (p["next"], p["above"], p["end"]) for s, p in state["input"]["streams"].items()}
    assert ends == {"0": (STEPS // 2, [], STEPS // 2), "1": (STEPS // 2, [], STEPS // 2)}


def test_a_run_killed_twice_mid_epoch_resumes_and_trains_every_row_exactly_epochs_times(
    spawn, tmp_path
):
    save = tmp_path / "save"
    first = _last_checkpoint(_killed_at(spawn, _run(save), r"step 15: checkpoint", "first"))
    again = _killed_at(spawn, _run(save), r"step 30: checkpoint", "second")
    assert "resuming from" in log_text(again)
    assert _resumed(log_text(again), first) < 30
    text = _finished(spawn(_run(save), "last"))
    second = _resumed(text, _last_checkpoint(again))
    assert f"steps {STEPS - second} timed (+0 warm-up) - resumed from step {second}" in text
    _check_every_row_trained_exactly_epochs_times(save)
    # The finished run is not resumed again: one line, exit 2, before TensorFlow.
    done = spawn(_run(save), "finished")
    assert done.wait(TIMEOUT_S) == 2
    assert "holds a finished run" in log_text(done) and "--fresh" in log_text(done)


def test_a_trainer_killed_while_its_producers_keep_running_resumes_exactly(spawn, tmp_path):
    save, port = tmp_path / "save", free_tcp_port()
    train = ["train", "--bind", f"tcp://127.0.0.1:{port}", *MODEL, "--save", str(save)]
    producers = spawn(["produce", "--connect", f"tcp://127.0.0.1:{port}", "--workers", "2",
                       "--schema", "tests.helpers.resume_models:SCHEMA", *SOURCE],
                           "producers")  # fmt: skip
    killed = _last_checkpoint(_killed_at(spawn, train, r"step 15: checkpoint", "trainer"))
    assert producers.proc.poll() is None  # they wait for a trainer, holding their batches
    text = _finished(spawn(train, "trainer-again"))
    assert f"resumed from step {_resumed(text, killed)}" in text
    assert producers.wait(TIMEOUT_S) == 0, log_text(producers)[-3000:]
    assert "the trainer moved shard" in log_text(producers)
    _check_every_row_trained_exactly_epochs_times(save)


def test_producers_that_finished_stay_until_their_shard_is_saved_and_feed_a_restarted_trainer(
    spawn, tmp_path
):
    save, port = tmp_path / "save", free_tcp_port()
    train = ["train", "--bind", f"tcp://127.0.0.1:{port}", *MODEL, "--save", str(save)]
    producers = spawn(["produce", "--connect", f"tcp://127.0.0.1:{port}", "--workers", "2",
                       "--schema", "tests.helpers.resume_models:SCHEMA", *SOURCE],
                           "producers")  # fmt: skip
    # Each checkpoint pauses 2 s between its model and its state file: the producers finish
    # (every batch and their end delivered) while the trainer still has their tail to train
    # or to save.
    trainer = _spawn_env(spawn, train, "trainer", cli_env(STAGEFEED_TEST_STATE_DELAY_S="2"))
    waiting = "waiting until a checkpoint of the trainer holds all 24 batches"
    assert wait_for(lambda: log_text(producers).count(waiting) == 2, TIMEOUT_S), (
        log_text(producers)[-3000:]
    )
    trainer.kill_group()
    assert not (save / "state.json").exists(), "killed too late: the run had ended"
    assert producers.proc.poll() is None  # finished, and staying for the checkpoint
    _finished(spawn(train, "trainer-again"))
    assert producers.wait(TIMEOUT_S) == 0, log_text(producers)[-3000:]
    text = log_text(producers)
    assert text.count("the trainer moved shard") == 2 and text.count("saved all 24") == 2, text
    _check_every_row_trained_exactly_epochs_times(save)


def test_producers_waiting_for_a_run_that_finished_by_its_steps_leave_with_it(spawn, tmp_path):
    """No rate limit, and each checkpoint pauses 1 s between its model and its state file:
    both producers deliver their 24 batches early and wait for ``saved``, which never comes
    (the 20 steps leave 28 batches untrained); the finished run's ``bye`` lets them go."""
    save, port = tmp_path / "save", free_tcp_port()
    # The later flag wins. A queue deep enough for every batch: by default it would be 20
    # deep (the planned steps), and the producers could not deliver all of theirs early.
    model = [*MODEL, "--steps", "20", "--queue-batches", "64"]
    producers = spawn(["produce", "--connect", f"tcp://127.0.0.1:{port}", "--workers", "2",
                       "--schema", "tests.helpers.resume_models:SCHEMA", "--source",
                       "tests.helpers.resume_models:rows"], "producers")  # fmt: skip
    trainer = _spawn_env(spawn, ["train", "--bind", f"tcp://127.0.0.1:{port}", *model, "--save",
                                 str(save)], "trainer", cli_env(STAGEFEED_TEST_STATE_DELAY_S="1"))
    _finished(trainer)
    assert producers.wait(TIMEOUT_S) == 0, log_text(producers)[-3000:]
    text = log_text(producers)
    assert text.count("waiting until a checkpoint of the trainer holds all 24 batches") == 2
    assert text.count("finished its run: no trainer will resume it") == 2, text[-3000:]
    with open(save / "state.json") as f:
        assert json.load(f)["finished"] == "20 steps done"


@pytest.mark.parametrize("transport", ["zmq"])
def test_a_kill_while_a_checkpoint_is_written_leaves_the_previous_one_in_use(
    spawn, tmp_path, transport
):
    save = tmp_path / "save"
    slow = cli_env(STAGEFEED_TEST_STATE_DELAY_S="5")
    args = [*_run(save), "--transport", transport]
    hook = r"(?s)step 5: checkpoint.*test hook"  # step 10's model written, its state not yet
    _killed_at(spawn, args, hook, "killed-writing", env=slow)
    assert (save / "checkpoints" / "model.ckpt-10.index").exists()
    assert not (save / "checkpoints" / "state-000010.json").exists()
    text = _finished(spawn(args, "last"))
    assert "state-000005.json: step 5" in text and "resumed from step 5" in text
    _check_every_row_trained_exactly_epochs_times(save)
