"""Keras ``fit`` resumes exactly (docs/resume.md): ``stagefeed run`` with a Keras ``--model``
killed with SIGKILL (its whole process group) mid-epoch, re-run with the same command until
it finishes; every row is then trained exactly ``EPOCHS`` times.

The model (``tests/helpers/resume_models.py:keras_counter``) counts, in a non-trainable weight, how
often each row was trained, and fits one scalar with Adam: its final value equals that of one
uninterrupted ``fit`` of the same number of steps only if the weights, Adam's moments and
``optimizer.iterations`` were restored and the run went on for the steps left, no more.

The position must hold what each step trained, never what tf.data prefetched: every
checkpoint's row counts are compared with the rows its state file's position names, on a run
whose queue and prefetch buffers are full when it stops (batches abandoned).
"""

from __future__ import annotations

import json
import re

import numpy as np

from tests.conftest import free_tcp_port, run_cli
from tests.helpers.procs import log_text, wait_log
from tests.helpers.resume_models import (
    BATCH,
    ROWS,
    keras_reference_w,
    keras_state_in,
    miscounted,
    stream,
)

STEPS = 2 * len(stream(0, 2))  # two shards, every pass: 48 steps in all
PER_EPOCH = 12  # fit's epochs: 4 of 12 steps; a checkpoint every 5 falls inside one
MODEL = [
    "--schema", "tests.helpers.resume_models:SCHEMA", "--model",
        "tests.helpers.resume_models:keras_counter",
    "--warmup-steps", "0", "--progress-s", "100", "--producer-timeout-s", "4",
]  # fmt: skip
TIMEOUT_S = 150


def _run(save, *extra: str) -> list[str]:
    return ["run", "--producers", "2", *MODEL, "--source", "tests.helpers.resume_models:rows",
            "--save", str(save), *extra]  # fmt: skip


def _killed_at(spawn, args: list[str], pattern: str, name: str):
    """Start ``args``, SIGKILL its whole process group once ``pattern`` is in its log."""
    started = spawn(args, name)
    assert wait_log(started, pattern, TIMEOUT_S), log_text(started)[-3000:]
    started.kill_group()
    return started


def _resumed_step(text: str) -> int:
    found = re.search(r"resuming from \S+state-(\d+)\.json: step (\d+)", text)
    assert found and int(found.group(1)) == int(found.group(2)), text[-3000:]
    return int(found.group(2))


def test_a_keras_run_killed_twice_mid_epoch_resumes_and_trains_every_row_exactly_epochs_times(
    spawn, tmp_path
):
    save = tmp_path / "save"
    args = _run(save, "--epochs", "4", "--steps-per-epoch", str(PER_EPOCH),
                "--checkpoint-every", "5", "--rate", "4")  # fmt: skip
    _killed_at(spawn, args, r"step 15: checkpoint", "first")
    # Killed at its first checkpoint of its own, whichever step it resumed from.
    again = _killed_at(spawn, args, r"resuming from(?s:.*)step \d+: checkpoint", "second")
    first_resume = _resumed_step(log_text(again))
    assert first_resume >= 15 and first_resume % 5 == 0
    last = spawn(args, "last")
    assert last.wait(TIMEOUT_S) == 0, log_text(last)[-4000:]
    text = log_text(last)
    base = _resumed_step(text)
    assert base > first_resume
    assert f"steps {STEPS - base} timed (+0 warm-up) - resumed from step {base}" in text
    assert f"epoch 4/4 done ({STEPS} steps)" in text
    counts, w, iterations = keras_state_in(str(save / "model.keras"))
    assert not miscounted(counts), miscounted(counts)
    assert iterations == STEPS
    assert np.isclose(w, keras_reference_w(STEPS), rtol=1e-6, atol=0), w
    with open(save / "state.json") as f:
        state = json.load(f)
    assert (state["step"], state["epoch"]) == (STEPS, 4) and state["finished"]
    # Every planned step done: a producer's ``end`` may come after the final state (null).
    trained = {s: (p["next"], p["above"]) for s, p in state["input"]["streams"].items()}
    assert trained == {"0": (STEPS // 2, []), "1": (STEPS // 2, [])}
    done = spawn(args, "finished")  # a finished run is not resumed: one line, exit 2
    assert done.wait(TIMEOUT_S) == 2 and "holds a finished run" in log_text(done)


def test_a_keras_trainer_killed_while_its_producers_keep_running_resumes_exactly(spawn, tmp_path):
    save, port = tmp_path / "save", free_tcp_port()
    train = ["train", "--bind", f"tcp://127.0.0.1:{port}", *MODEL, "--steps", "0",
             "--checkpoint-every", "5", "--save", str(save)]  # fmt: skip
    producers = spawn(["produce", "--connect", f"tcp://127.0.0.1:{port}", "--workers", "2",
                       "--schema", "tests.helpers.resume_models:SCHEMA", "--source",
                       "tests.helpers.resume_models:rows", "--rate", "4"], "producers")  # fmt: skip
    _killed_at(spawn, train, r"step 15: checkpoint", "trainer")
    assert producers.proc.poll() is None  # they wait for a trainer, holding their batches
    last = spawn(train, "trainer-again")
    assert last.wait(TIMEOUT_S) == 0, log_text(last)[-4000:]
    assert f"resumed from step {_resumed_step(log_text(last))}" in log_text(last)
    assert producers.wait(TIMEOUT_S) == 0, log_text(producers)[-3000:]
    assert "the trainer moved shard" in log_text(producers)
    counts, w, iterations = keras_state_in(str(save / "model.keras"))
    assert not miscounted(counts), miscounted(counts)
    assert iterations == STEPS
    assert np.isclose(w, keras_reference_w(STEPS), rtol=1e-6, atol=0), w


def _rows_of(position: dict) -> np.ndarray:
    """Row counts that the batches of ``position`` (an ``"input"``) add up to."""
    counts = np.zeros(ROWS, np.float32)
    for shard, p in position["streams"].items():
        batches = stream(int(shard), position["shards"])
        for seq in [*range(p["next"]), *p["above"]]:
            counts[batches[seq]] += 1
    return counts


def test_every_keras_checkpoint_holds_exactly_the_batches_its_model_trained(tmp_path):
    """No rate limit: the producers are far ahead, tf.data's buffers hold batches at every
    checkpoint and when the 20 steps are done (abandoned). A position that counted what was
    dequeued, not what the steps trained, names rows the model never counted."""
    save, summary = tmp_path / "save", tmp_path / "summary.json"
    done = run_cli(
        # A queue deeper than the 20 planned steps (by default it would be 20 deep), so that
        # the producers are far ahead and tf.data holds batches when the steps are done.
        [*_run(save, "--steps", "20", "--checkpoint-every", "3", "--queue-batches", "64"),
         "--json", str(summary)],
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(summary) as f:
        batches = json.load(f)["batches"]
    assert batches["trained"] == 20 and batches["abandoned"] > 0, batches
    pairs = [(save / "checkpoints" / f"state-{s:06d}.json", save / "checkpoints" /
              f"step-{s:06d}.keras") for s in range(3, 20, 3)]  # fmt: skip
    for state_path, model_path in [*pairs, (save / "state.json", save / "model.keras")]:
        with open(state_path) as f:
            state = json.load(f)
        counts, _, iterations = keras_state_in(str(model_path))
        assert iterations == state["step"]
        assert counts.sum() == BATCH * state["step"]
        assert np.array_equal(counts, _rows_of(state["input"])), (state_path.name, state["input"])
