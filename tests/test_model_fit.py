"""A model whose output does not fit the targets (issue 28, defect 3), through the real CLI:
refused at start in one line naming the model (exit 2) when the schema says so (the labels'
bounds against a sparse crossentropy's classes, one step traced on the schema's shapes); a
train step that fails all the same ends the run with the summary, then one line naming the
model and what TensorFlow said (exit 3), in Keras and in graph mode; and
``ServedFeed.check_model`` raising one ``ConfigError`` for the same mismatches
(consumer/keras_fit/model_check.py, consumer/model_ref.py, consumer/tf2/feed.py)."""

from __future__ import annotations

import pytest

import stagefeed
from examples import keras_images
from stagefeed import ServedFeed, TrainerOptions
from tests.conftest import run_cli
from tests.helpers import model_fit, regression_models

IMAGES = [
    "run", "--schema", "examples.keras_images:SCHEMA", "--source", "examples.keras_images:batches",
    "--producers", "1", "--steps", "5",
]  # fmt: skip
REGRESSION = [
    "run", "--schema", "tests.helpers.regression_models:SCHEMA", "--source",
        "tests.helpers.regression_models:sums",
    "--producers", "1", "--steps", "5",
]  # fmt: skip


def _refused_at_start(done, model: str) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    said = f"stagefeed: error: --model 'tests.helpers.model_fit:{model}': "
    assert lines[-1].startswith(said), lines
    assert "producers ->" not in done.stderr and "stagefeed-producer" not in done.stderr
    assert done.stdout == ""  # refused at start: no run, no summary
    return lines[-1]


def test_three_classes_for_labels_up_to_9_are_refused_at_start():
    done = run_cli([*IMAGES, "--model", "tests.helpers.model_fit:three_classes"])
    line = _refused_at_start(done, "three_classes")
    assert "output 'dense' has 3 classes, but the target 'labels' is in [0, 10)" in line, line


def test_a_ten_wide_output_for_scalar_targets_with_mse_is_refused_at_start():
    done = run_cli([*REGRESSION, "--model", "tests.helpers.model_fit:ten_outputs"])
    line = _refused_at_start(done, "ten_outputs")
    assert "one training step on the schema's batch fails: ValueError: Dimensions must be" in line
    assert "[4], [4,10]" in line, line


@pytest.mark.parametrize("model", ["three_classes", "three_classes_fn"], ids=["keras", "graph"])
def test_a_step_that_fails_ends_with_the_summary_then_one_line_naming_the_model(model):
    """Labels without bounds: nothing to check at start; TensorFlow refuses label 9 for 3
    classes at the first step (on a CPU)."""
    done = run_cli(
        [
            *IMAGES[:2],
            "tests.helpers.model_fit:UNBOUNDED",
            *IMAGES[3:],
            "--model",
            f"tests.helpers.model_fit:{model}",
        ]
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "stagefeed summary" in done.stdout, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert f"ERROR MainProcess stagefeed: --model 'tests.helpers.model_fit:{model}': a train " \
        "step failed: InvalidArgumentError: " in last, last  # fmt: skip
    assert "outside the valid range of [0, 3)" in last, last


def _served(schema) -> ServedFeed:
    return ServedFeed(TrainerOptions(bind="tcp://127.0.0.1:*", schema=schema, queue_mb=8))


@pytest.mark.parametrize(
    ("build", "schema", "mapping", "named"),
    [
        (model_fit.three_classes, keras_images.SCHEMA, ("images", "labels"),  # Keras names
         "has 3 classes, but the target 'labels' is in [0, 10)"),  # the layer by process
        (model_fit.ten_outputs, regression_models.SCHEMA, ("features", "targets"),
         "one training step on the dataset's elements fails: ValueError: Dimensions must be"),
        (model_fit.ten_outputs, regression_models.SCHEMA,
         lambda batch: (batch["features"], batch["targets"]),
         "one training step on the dataset's elements fails: ValueError: Dimensions must be"),
    ],
    ids=["classes", "shape", "shape-callable-mapping"],
)  # fmt: skip
def test_served_feed_check_model_raises_one_config_error_naming_the_model(
    build, schema, mapping, named
):
    with _served(schema) as feed:
        feed.dataset(mapping, cast="step")
        model = build(schema)
        with pytest.raises(stagefeed.ConfigError) as refused:
            feed.check_model(model)
        # and what fit would do is untouched: nothing ran, no counter moved
        assert int(model.optimizer.iterations) == 0
    message = str(refused.value)
    assert message.startswith(f"model {model.name!r}: ") and named in message, message
    assert "\n" not in message, message


def test_served_feed_check_model_takes_a_model_that_fits():
    with _served(keras_images.SCHEMA) as feed:
        feed.dataset(("images", "labels"), cast="step")
        feed.check_model(keras_images.build(keras_images.SCHEMA))
