"""The run's length and "finished" decided by what was planned and trained (issue 28, defects 2
and 4): real ``stagefeed run`` processes, two producer processes each, on the sources with
passes and the row-counting models of ``tests/helpers/run_length_models.py``.

Defect 2: producers slower than the trainer (0.02-0.15 s a batch), so the last pass is trained
and saved before the producers' ``end`` reaches the trainer. The final state must still say
``finished``, and the same command run again is refused (exit 2, one line) instead of training
every row once more. Defect 4: ``--epochs 1`` (the default) and no ``--steps`` trains the whole
pass of a source with passes; an explicit, shorter ``--steps`` is a short run (the warning).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import free_tcp_port, run_cli
from tests.helpers.procs import log_text, wait_log
from tests.helpers.run_length_models import PER_PASS, ROWS, graph_counts, keras_counts

PASSES = 3
BASE = [
    "run", "--producers", "2", "--schema", "tests.helpers.run_length_models:SCHEMA",
    "--warmup-steps", "0", "--progress-s", "100",
]  # fmt: skip
MODELS = {
    "graph": ("tests.helpers.run_length_models:row_counter", "model.ckpt"),
    "keras": ("tests.helpers.run_length_models:keras_counter", "model.keras"),
}


def _counts(kind: str, save) -> np.ndarray:
    model_file = str(save / MODELS[kind][1])
    return graph_counts(model_file) if kind == "graph" else keras_counts(model_file)


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_finished_run_of_passes_with_slow_producers_is_finished_and_not_trained_again(
    tmp_path, kind
):
    save = tmp_path / "save"
    command = [*BASE, "--model", MODELS[kind][0], "--source",
        "tests.helpers.run_length_models:slow_rows",
               "--epochs", str(PASSES), "--save", str(save)]  # fmt: skip
    done = run_cli(command, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert not (_counts(kind, save) != PASSES).any(), _counts(kind, save)
    state = json.loads((save / "state.json").read_text())
    assert state["step"] == PASSES * PER_PASS, state
    # Whichever came first: the last pass trained, or (now and then) the producers' end.
    reasons = (f"its passes trained (--epochs {PASSES})", "every producer's data ended")
    assert state["finished"] in reasons, state
    assert state["epoch"] == PASSES, state
    # A normal end: each producer is let go by the trainer, not stopped while it waits.
    assert "stopped before the trainer saved" not in out, out[-4000:]
    assert out.count(f"the trainer saved all {PASSES * PER_PASS // 2} batches") == 2, out[-4000:]
    assert "waiting for it to come back" not in out, out[-4000:]

    # Run again as it is, and as the trainer before the fix left it when its save came before
    # the producers' end ("finished": false): both are refused, no row is trained again.
    for finished in (state["finished"], False):
        (save / "state.json").write_text(json.dumps({**state, "finished": finished}))
        again = run_cli(command, timeout=240)
        assert again.returncode == 2, (again.stdout + again.stderr)[-4000:]
        errors = [line for line in again.stderr.splitlines() if line.startswith("stagefeed: e")]
        assert len(errors) == 1 and "holds a finished run" in errors[0], again.stderr[-3000:]
        assert "Traceback" not in again.stderr
        assert not (_counts(kind, save) != PASSES).any(), {  # no row trained PASSES + 1 times
            "rows not trained exactly 3 times": int((_counts(kind, save) != PASSES).sum())
        }


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_default_length_of_a_run_of_passes_is_its_passes(tmp_path, kind):
    """``--epochs 1`` and no ``--steps``: the whole pass (48 batches, more than the default 30
    + 2 steps), every row once, epochs filled in the summary and its JSON, no warning."""
    save, summary = tmp_path / "save", tmp_path / "summary.json"
    done = run_cli([
        *BASE, "--model", MODELS[kind][0], "--source", "tests.helpers.run_length_models:fast_rows",
        "--save", str(save), "--json", str(summary),
    ], timeout=240)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"steps {PER_PASS} timed" in done.stdout, done.stdout
    assert "WARNING" not in done.stdout, out[-4000:]
    counts = _counts(kind, save)
    assert counts.shape == (ROWS,) and not (counts != 1).any(), counts
    run_length = json.loads(summary.read_text())["run_length"]
    assert run_length == {
        "planned_steps": None, "steps_done": PER_PASS, "planned_epochs": 1, "epochs_done": 1,
        "complete": True, "short_because": None,
    }, run_length  # fmt: skip
    state = json.loads((save / "state.json").read_text())
    reasons = ("its passes trained (--epochs 1)", "every producer's data ended")
    assert state["epoch"] == 1 and state["finished"] in reasons, state


def test_an_explicit_steps_shorter_than_the_passes_is_a_short_run(tmp_path):
    summary = tmp_path / "summary.json"
    done = run_cli([
        *BASE, "--model", MODELS["graph"][0], "--source",
            "tests.helpers.run_length_models:fast_rows",
        "--steps", "10", "--json", str(summary),
    ], timeout=240)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    warning = [line for line in done.stdout.splitlines() if "WARNING: ended after" in line]
    assert len(warning) == 1, done.stdout
    assert "10 of 10 planned steps, 0 of 1 epochs" in warning[0], warning
    run_length = json.loads(summary.read_text())["run_length"]
    assert run_length["complete"] is False and run_length["epochs_done"] == 0, run_length
    assert "--steps" in run_length["short_because"], run_length


def test_train_and_produce_train_the_passes_with_the_default_steps_and_end_finished(
    spawn, tmp_path
):
    """``train`` without ``--steps`` and two slow producers: the passes decide the length
    (144 steps), the state is finished with its epochs, each producer is let go by the final
    checkpoint, and ``train`` again on that directory is refused."""
    save, endpoint = tmp_path / "save", f"tcp://127.0.0.1:{free_tcp_port()}"
    command = ["train", "--bind", endpoint, "--schema", "tests.helpers.run_length_models:SCHEMA",
               "--model", MODELS["graph"][0], "--epochs", str(PASSES), "--warmup-steps", "0",
               "--progress-s", "100", "--save", str(save)]  # fmt: skip
    trainer = spawn(command, "trainer")
    assert wait_log(trainer, r"listening on tcp://", 90), log_text(trainer)[-3000:]
    producers = spawn(["produce", "--connect", endpoint, "--workers", "2", "--schema",
                       "tests.helpers.run_length_models:SCHEMA", "--source",
                       "tests.helpers.run_length_models:slow_rows"], "producers")  # fmt: skip
    assert trainer.wait(240) == 0, log_text(trainer)[-4000:]
    assert producers.wait(60) == 0, log_text(producers)[-4000:]
    assert f"steps {PASSES * PER_PASS} timed" in log_text(trainer), log_text(trainer)[-3000:]
    assert not (_counts("graph", save) != PASSES).any(), _counts("graph", save)
    state = json.loads((save / "state.json").read_text())
    assert state["finished"] and state["epoch"] == PASSES, state
    text = log_text(producers)
    assert text.count(f"the trainer saved all {PASSES * PER_PASS // 2} batches") == 2, text[-3000:]

    again = spawn(command, "again")
    assert again.wait(120) == 2, log_text(again)[-3000:]
    assert "holds a finished run" in log_text(again) and "Traceback" not in log_text(again)
