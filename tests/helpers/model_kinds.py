"""``--model`` callables whose kind their required-parameter count would get wrong (for
``tests/test_model_kinds.py``): defaults accepted, ambiguity settled by a mark, never guessed.
Schema and batches: ``tests.helpers.regression_models``."""

from __future__ import annotations

import stagefeed
from tests.helpers import regression_models


def build_default(schema=None):
    """A Keras build whose schema has a default: one argument is all it can take."""
    return regression_models.build(schema)


@stagefeed.graph_model
def linear_fn_default(staged, schema=None):
    """A graph model_fn whose schema has a default, marked: it could also be called as a build."""
    return regression_models.linear_fn(staged, schema)


def unmarked_fn_default(staged, schema=None):
    """The same, unmarked: a build(schema) or a model_fn(staged, schema)? Refused, not guessed."""
    return regression_models.linear_fn(staged, schema)


@stagefeed.keras_model
def build_with_options(schema, learning_rate=0.1):
    """A Keras build with an optional parameter, marked (two arguments would bind too)."""
    return regression_models.build(schema)


def no_parameters():
    return regression_models.build(None)


@stagefeed.keras_model
def marked_keras_takes_two(staged, schema):
    return regression_models.linear_fn(staged, schema)


@stagefeed.graph_model
def marked_graph_returns_a_model(staged, schema=None):
    """Marked graph, but returns what a build would: refused when the graph is built."""
    return regression_models.build(schema)


def badly_marked(schema):
    return regression_models.build(schema)


badly_marked.stagefeed_model_kind = "fit"  # type: ignore[attr-defined]
