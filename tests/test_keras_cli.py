"""``stagefeed run --model pkg.mod:build``: a compiled Keras model trained with ``model.fit`` on
batches from a real producer process, with epochs, --save, checkpoints and --on-nan warn
(the stop is in tests/test_run_length.py); and every way a Keras build can break the
convention, refused at start naming the model."""

from __future__ import annotations

import json
import re
import signal

import numpy as np
import pytest

from examples import keras_images
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.tf_config import NO_CLUSTER
from stagefeed.consumer import trainers
from tests.conftest import run_cli, wait_for
from tests.helpers import regression_models

IMAGES = [
    "run", "--schema", "examples.keras_images:SCHEMA", "--model", "examples.keras_images:build",
    "--source", "examples.keras_images:batches", "--producers", "1",
]  # fmt: skip
REGRESSION = [
    "run", "--schema", "tests.helpers.regression_models:SCHEMA", "--model",
        "tests.helpers.regression_models:build",
    "--source", "tests.helpers.regression_models:nan_from_third", "--producers", "1",
        "--enqueue-threads",
    "1", "--warmup-steps", "0",
]  # fmt: skip


def test_fit_runs_epochs_times_steps_saves_a_model_that_reloads_and_checkpoints(tmp_path):
    import keras

    done = run_cli([
        *IMAGES, "--epochs", "2", "--steps-per-epoch", "4", "--save", str(tmp_path),
        "--checkpoint-every", "4",
    ])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epoch 2/2 done (8 steps)" in done.stderr
    assert "steps 6 timed (+2 warm-up)" in done.stdout, done.stdout
    assert "trained 8," in done.stdout and "dropped 0," in done.stdout
    assert "stall " in done.stdout and "(finite: True)" in done.stdout
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == [
        "state-000004.json", "state-000008.json", "step-000004.keras", "step-000008.keras"
    ]  # fmt: skip
    with open(tmp_path / "checkpoints" / "state-000008.json") as f:
        state = json.load(f)
    assert (state["step"], state["epoch"], state["model_files"]) == (8, 2, ["step-000008.keras"])
    assert (tmp_path / "state.json").exists()
    model = keras.models.load_model(tmp_path / "model.keras")
    last = keras.models.load_model(tmp_path / "checkpoints" / "step-000008.keras")
    images = next(keras_images.user_batches(seed=1))["images"]
    predicted = np.asarray(model.predict(images, verbose=0))
    assert predicted.shape == (16, keras_images.CLASSES) and np.isfinite(predicted).all()
    assert np.array_equal(predicted, np.asarray(last.predict(images, verbose=0)))


def test_warn_only_warns_and_a_finite_source_is_trained_to_its_last_batch():
    done = run_cli([*REGRESSION, "--on-nan", "warn", "--steps", "0", "--max-batches", "6"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 3: loss is nan; training goes on (--on-nan warn)" in done.stderr
    assert "steps 6 timed (+0 warm-up) - every producer's data ended" in done.stdout
    assert "(finite: False)" in done.stdout
    assert "received 6, trained 6, queued at stop 0," in done.stdout, done.stdout


def test_steps_per_execution_counts_every_step_of_each_call_in_the_figures(tmp_path):
    """A model compiled with ``steps_per_execution=3`` whose every step sleeps 0.2 s: Keras
    calls back once per call of 3 steps. The figures are per step: ms/step near 0.2 s, not a
    call's 0.6 s (they counted a call as one step, and examples/s a third of the rate)."""
    done = run_cli([
        "run", "--schema", "tests.helpers.regression_models:SCHEMA", "--model",
        "tests.helpers.regression_models:build_in_calls_of_3", "--source",
        "tests.helpers.regression_models:sums", "--producers", "1", "--warmup-steps", "0",
        "--steps", "0", "--max-batches", "9", "--json", str(tmp_path / "summary.json"),
    ])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "received 9, trained 9, queued at stop 0," in done.stdout, done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    pause_ms = 1000 * regression_models.STEP_PAUSE_S
    assert pause_ms <= summary["median_ms"] < 2 * pause_ms, summary
    assert summary["examples_per_s"] > 4 / (2 * regression_models.STEP_PAUSE_S), summary


def test_sigint_stops_fit_while_it_waits_for_batches_and_the_summary_follows(start_cli):
    run = start_cli([*IMAGES, "--steps", "0", "--rate", "4", "--progress-s", "0.5"], name="run")
    # A progress line at step 4 or later (lines come every 0.5 s, not at every step).
    past_step_3 = re.compile(r"step ([4-9]|\d\d+)/- ")
    assert wait_for(lambda: past_step_3.search(run.output()), 120), run.output()[-3000:]
    run.signal(signal.SIGINT)  # fit is starved: its dequeue waits for the next batch
    assert run.wait(30) == 0, run.output()[-3000:]
    output = run.output()
    assert "timed (+2 warm-up) - interrupted" in output and "Traceback" not in output


@pytest.mark.parametrize(
    ("build", "named"),
    [
        ("tests.helpers.regression_models:nope", "has no 'nope'"),
        ("tests.no_such_module:build", "no_such_module"),
        ("tests.helpers.regression_models:not_a_model", "returned a str, not a keras.Model"),
        ("tests.helpers.regression_models:uncompiled", "not compiled with a loss"),
        ("tests.helpers.regression_models:wrong_name",
            "input 'inputs' is not an array of the schema"),
        ("tests.helpers.regression_models:wrong_shape", "has shape [None, 4], the array is [4, 3]"),
        ("tests.helpers.regression_models:wrong_dtype", "input 'features' is int32"),
        ("tests.helpers.regression_models:fails",
            "failed to build: RuntimeError: 'no GPU memory left'"),
    ],
)
def test_a_keras_build_that_breaks_the_convention_is_refused_before_binding(build, named):
    options = TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=regression_models.SCHEMA, model=build, queue_mb=1
    )
    with pytest.raises(ConfigError) as refused:
        trainers.trainer(options, place=NO_CLUSTER).start()
    message = str(refused.value)
    assert message.startswith(f"--model {build!r}"), message
    assert named in message and "\n" not in message, message


def test_targets_must_match_the_outputs():
    options = TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=regression_models.SCHEMA,
        model="tests.helpers.regression_models:build", queue_mb=1, targets=("targets", "features"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="cannot be both an input and a target"):
        trainers.trainer(options, place=NO_CLUSTER).start()


def test_a_bad_model_on_the_command_line_is_one_line_and_exit_2_before_any_producer():
    done = run_cli([*REGRESSION, "--model", "tests.helpers.regression_models:wrong_shape"])
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("stagefeed: error: --model "
        "'tests.helpers.regression_models:wrong_shape'")
    assert "Traceback" not in done.stderr and "producers ->" not in done.stderr
    assert "stagefeed-producer" not in done.stderr and done.stdout == ""


@pytest.mark.parametrize("model", ["build", "linear_fn"], ids=["keras", "graph"])
def test_a_source_that_sends_a_wrong_batch_ends_the_run_in_one_line_in_every_mode(model):
    """The producer refuses the batch and fails; the trainer's run ends (``RunEnd``: FAIL),
    Keras ``fit`` included, with the producer's one line and exit code 2, never a hang."""
    done = run_cli(
        [*REGRESSION, "--model", f"tests.helpers.regression_models:{model}", "--steps", "0",
         "--source", "tests.helpers.regression_models:wrong_third"], timeout=90,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("stagefeed: error:")]
    assert len(errors) == 1 and "wrong_third' batch 2 is short: 3 rows" in errors[0], errors
    assert "pass --short-batch drop" in errors[0]
    assert done.stderr.strip().splitlines()[-1] == errors[0]  # the last line: what to fix
    assert "stagefeed summary" in done.stdout, done.stdout
    assert "received 2, trained 2," in done.stdout, done.stdout  # the good ones, trained
    assert "Traceback" not in done.stderr
