"""The CLI's run length and loss policy: epochs x steps per epoch, --save and checkpoints in
graph mode, and a non-finite loss stopping graph mode and Keras alike.

Real ``stagefeed run`` processes with one real producer process each, on the tiny regression
of ``tests/helpers/regression_models.py``. The flag checks parse and build the options in this
process
(``main`` turns their ``ConfigError`` into one line and exit code 2, as for every flag).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tensorflow as tf

from stagefeed.cli import build_parser, trainer_options
from stagefeed.common.errors import ConfigError
from tests.conftest import cli_env, run_cli

REGRESSION = [
    "run", "--schema", "tests.helpers.regression_models:SCHEMA", "--producers", "1",
    "--enqueue-threads", "1", "--warmup-steps", "0",
]  # fmt: skip
GRAPH = ["--model", "tests.helpers.regression_models:linear_fn"]
NAN_SOURCE = ["--source", "tests.helpers.regression_models:nan_from_third"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--steps", "5", "--steps-per-epoch", "2"], "--steps 5 with --steps-per-epoch 2"),
        (["--checkpoint-every", "2"], "checkpoint_every=2 needs save_dir"),
        (["--steps-per-epoch", "-1"], "steps_per_epoch must be an integer >= 0, got -1"),
        (["--targets", "features,nope"], "targets must be names of the schema's arrays"),
    ],
)
def test_a_bad_run_length_flag_is_refused_naming_it(flags, named):
    args = build_parser().parse_args([*REGRESSION, *GRAPH, *flags])
    with pytest.raises(ConfigError, match=named):
        trainer_options(args, "tcp://127.0.0.1:*")


@pytest.mark.parametrize(
    ("model", "saved"),
    [("tests.helpers.regression_models:linear_fn", "model.ckpt.index"),
     ("tests.helpers.regression_models:build", "model.keras")],  # fmt: skip
    ids=["graph", "keras"],
)
def test_a_nan_loss_stops_the_run_with_exit_4_naming_the_step(tmp_path, model, saved):
    done = run_cli(
        [*REGRESSION, "--model", model, *NAN_SOURCE, "--steps", "20", "--save", str(tmp_path)]
    )
    assert done.returncode == 4, done.stderr[-3000:]
    stopped = [line for line in done.stderr.splitlines() if "training stopped" in line]
    assert len(stopped) == 1 and "step 3: loss is nan" in stopped[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "steps 3 timed" in done.stdout and "(finite: False)" in done.stdout
    assert not (tmp_path / saved).exists()  # non-finite weights are not saved


def test_warn_goes_on_for_every_epoch_and_saves_checkpoints_and_the_model(tmp_path):
    """Also TensorFlow's start-up lines, off by default: the run's environment lacks
    ``TF_CPP_MIN_LOG_LEVEL`` (``quiet_env``), as a user's shell does."""
    done = run_cli([
        *REGRESSION, *GRAPH, *NAN_SOURCE, "--on-nan", "warn", "--epochs", "2",
        "--steps-per-epoch", "3", "--save", str(tmp_path), "--checkpoint-every", "2",
    ], env=quiet_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert banner_lines(done.stderr) == [], done.stderr[-3000:]
    assert "step 3: loss is nan; training goes on" in done.stderr
    assert "epoch 2/2 done (6 steps)" in done.stderr
    assert "steps 6 timed (+0 warm-up)" in done.stdout
    assert "batches received" in done.stdout and "trained 6," in done.stdout
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.index"))
    assert checkpoints == ["model.ckpt-2.index", "model.ckpt-4.index", "model.ckpt-6.index"]
    states = sorted(p.name for p in (tmp_path / "checkpoints").glob("state-*.json"))
    assert states == ["state-000002.json", "state-000004.json", "state-000006.json"]
    with open(tmp_path / "checkpoints" / "state-000004.json") as f:
        state = json.load(f)
    assert (state["step"], state["epoch"]) == (4, 1)
    assert sorted(state["model_files"]) == sorted(
        p.name for p in (tmp_path / "checkpoints").glob("model.ckpt-4.*")
    )
    reader = tf.train.load_checkpoint(str(tmp_path / "model.ckpt"))
    assert reader.get_variable_to_shape_map()["w"] == [3, 1]


@pytest.mark.parametrize(
    ("model", "required", "code"),
    [("tests.helpers.regression_models:linear_fn", False, 0),
     ("tests.helpers.regression_models:build", False, 0),
     ("tests.helpers.regression_models:build", True, 5)],  # fmt: skip
    ids=["graph", "keras", "keras-required"],
)
def test_data_that_ends_before_the_planned_epochs_is_a_warning_or_exit_5(
    tmp_path, model, required, code
):
    """Issue 20 item 3: 6 batches for 2 epochs of 5 steps. The run trains all 6 and says in
    its summary (text and JSON) that it ended short, and why; --require-full-run exits 5."""
    out = tmp_path / "summary.json"
    done = run_cli([
        *REGRESSION, "--model", model, "--epochs", "2", "--steps-per-epoch", "5",
        "--max-batches", "6", "--json", str(out), "--save", str(tmp_path / "model"),
        *(["--require-full-run"] if required else []),
    ])  # fmt: skip
    assert done.returncode == code, done.stderr[-3000:]
    warning = [line for line in done.stdout.splitlines() if "WARNING: ended after" in line]
    assert len(warning) == 1, done.stdout
    assert "6 of 10 planned steps, 1 of 2 epochs: every producer's data ended" in warning[0]
    summary = json.loads(out.read_text())
    assert summary["run_length"] == {
        "planned_steps": 10, "steps_done": 6, "planned_epochs": 2, "epochs_done": 1,
        "complete": False, "short_because": "every producer's data ended",
    }  # fmt: skip
    assert summary["batches"]["trained"] == 6 and "Traceback" not in done.stderr
    assert "input wait" not in done.stderr  # one wait figure: the summary's stall
    if required:
        assert "--require-full-run: every producer's data ended" in done.stderr
    if model.endswith(":build"):  # Keras counted the call that met the end as a 7th iteration
        import keras

        assert set(summary["metrics"]) == {"mae"} and summary["metrics"]["mae"] >= 0
        assert "; metrics mae " in done.stdout  # the compiled metrics, not only the loss

        saved = keras.models.load_model(tmp_path / "model" / "model.keras")
        assert int(saved.optimizer.iterations) == 6


BANNER = ("cpu_feature_guard", "oneDNN custom operations", "absl::InitializeLog")
# oneDNN's optimisations on whatever the CPU, so its load-time banner is printed on every machine.
ONEDNN_ON = {"TF_ENABLE_ONEDNN_OPTS": "1"}


def banner_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(b in line for b in BANNER)]


def quiet_env() -> dict[str, str]:
    """The tests' environment without ``TF_CPP_MIN_LOG_LEVEL`` (every other test's is 2), with
    oneDNN's banner due: stagefeed alone must keep TensorFlow's start-up lines off."""
    return {k: v for k, v in cli_env(**ONEDNN_ON).items() if k != "TF_CPP_MIN_LOG_LEVEL"}


def test_tensorflow_start_up_lines_show_once_each_when_asked_for():
    # The public API loads TensorFlow through the same filter as the command line.
    load = "import stagefeed; stagefeed.ServedFeed"
    env = cli_env(TF_CPP_MIN_LOG_LEVEL="0", **ONEDNN_ON)
    done = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = banner_lines(done.stderr)
    shown = {b for b in BANNER for line in lines if b in line}
    assert "oneDNN custom operations" in shown and len(lines) == len(shown), lines
