"""``--model``: a Keras ``build`` and a graph ``model_fn`` are told apart by how they can be
called and by an explicit mark, not by their required parameters: defaults are accepted
(``build(schema=None)``, a marked ``model_fn(staged, schema=None)``), a callable that could be
either or neither is refused in one line that names the fix, and a marked model_fn that
returns a Keras model is refused at start (consumer/model_ref.py, consumer/trainers.py)."""

from __future__ import annotations

import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.tf_config import NO_CLUSTER
from stagefeed.consumer import model_ref, trainers
from tests.conftest import run_cli
from tests.helpers import regression_models

M = "tests.helpers.model_kinds:"


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("build_default", "keras"),  # once refused: "takes 0 parameters"
        ("linear_fn_default", "graph"),  # once taken for a Keras build
        ("build_with_options", "keras"),  # once taken for a graph model_fn
        ("tests.helpers.regression_models:build", "keras"),
        ("tests.helpers.regression_models:linear_fn", "graph"),
        ("alexnet", "graph"),
    ],
)
def test_each_kind_is_resolved_defaults_and_marks_included(name, kind):
    ref = name if ":" in name or name == "alexnet" else M + name
    assert model_ref.resolve(ref)[0] == kind


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("unmarked_fn_default", "unmarked_fn_default(staged, schema=None) could be a graph "
         "model_fn(staged, schema) or a Keras build(schema); mark it @stagefeed.graph_model or "
         "@stagefeed.keras_model"),
        ("no_parameters", "no_parameters() is neither a graph model_fn(staged, schema) nor a "
         "Keras build(schema)"),
        ("marked_keras_takes_two", "is marked keras but cannot be called as build(schema): it is "
         "marked_keras_takes_two(staged, schema)"),
        ("badly_marked", "stagefeed_model_kind is 'fit', not 'graph' or 'keras'"),
    ],
)  # fmt: skip
def test_a_callable_of_no_one_kind_is_refused_in_one_line_naming_the_fix(name, named):
    with pytest.raises(ConfigError) as refused:
        model_ref.resolve(M + name)
    message = str(refused.value)
    assert message.startswith(f"--model {M + name!r}"), message
    assert named in message and "\n" not in message, message


def _options(model: str) -> TrainerOptions:
    return TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=regression_models.SCHEMA, model=model, queue_mb=1
    )


@pytest.mark.parametrize(
    ("name", "trainer"), [("build_default", "KerasTrainer"), ("linear_fn_default", "Trainer")]
)
def test_defaults_build_and_start_the_trainer_of_their_kind(name, trainer):
    started = trainers.trainer(_options(M + name), place=NO_CLUSTER).start()
    try:
        assert type(started).__name__ == trainer
        assert started.endpoint.startswith("tcp://127.0.0.1:")
    finally:
        started.close()


def test_a_marked_model_fn_that_returns_a_keras_model_is_refused_at_start():
    with pytest.raises(ConfigError) as refused:
        trainers.trainer(_options(M + "marked_graph_returns_a_model"), place=NO_CLUSTER).start()
    message = str(refused.value)
    assert message.startswith(f"--model {M + 'marked_graph_returns_a_model'!r}: "), message
    assert "returned a Functional, not (loss, train_op); a Keras build? mark it" in message


def test_an_ambiguous_model_on_the_command_line_is_one_line_and_exit_2():
    done = run_cli([
        "train", "--bind", "tcp://127.0.0.1:0", "--schema",
            "tests.helpers.regression_models:SCHEMA",
        "--model", M + "unmarked_fn_default",
    ], timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"stagefeed: error: --model {M + 'unmarked_fn_default'!r}: "), last
    assert "mark it @stagefeed.graph_model" in last and "Traceback" not in done.stderr
