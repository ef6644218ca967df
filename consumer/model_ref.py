"""``--model module:NAME``: what the trainer trains, resolved and checked at start.

Two kinds of model, told apart by the function's parameters:

- a graph-mode ``model_fn(staged, schema) -> (loss, train_op)``: ``staged`` is a dict of the
  schema's arrays as staged on the training device (cast and scaled as the schema declares);
  it builds its variables and returns the loss tensor and the train op. The seed's AlexNet is
  one (``alexnet``, the default). The staged batch's sequence number and connection index
  are in the graph collections ``consumer.graph.feed_graph.STAGED_SEQ`` / ``STAGED_PEER``.
- a Keras ``build(schema) -> keras.Model``, compiled: trained with ``model.fit`` on the feed's
  ``tf.data.Dataset``.

Any failure (cannot import, not callable, wrong parameters, the model refuses the schema, an
exception while building, a Keras model that does not fit the schema:
``consumer.keras_fit.model_check``)
is a ``ConfigError`` naming the model, raised before any producer is started. ``trainer()``
makes the trainer of either kind; only the Keras kind imports Keras.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from stagefeed.common.errors import ConfigError
from stagefeed.common.excerpt import excerpt
from stagefeed.common.refs import import_ref

if TYPE_CHECKING:
    from stagefeed.common.options import TrainerOptions
    from stagefeed.consumer.graph.trainer import Trainer
    from stagefeed.consumer.keras_fit.trainer import KerasTrainer
    from stagefeed.consumer.trainer_base import StepObserver

DEFAULT_MODEL = "alexnet"
GRAPH = "graph"
KERAS = "keras"


def resolve(ref: str) -> tuple[str, Callable[..., Any]]:
    """(kind, callable) for ``--model``: ``alexnet`` or ``module:NAME``."""
    if ref == DEFAULT_MODEL:
        from stagefeed.consumer.graph.alexnet import model_fn

        return GRAPH, model_fn
    value = import_ref(ref, "--model")
    if not callable(value):
        raise ConfigError(f"--model {ref!r} is a {type(value).__name__}, not a function")
    try:
        params = [
            p for p in inspect.signature(value).parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]  # fmt: skip
    except (TypeError, ValueError):
        raise ConfigError(f"--model {ref!r}: its parameters cannot be read") from None
    if len(params) == 2:
        return GRAPH, value
    if len(params) == 1:
        return KERAS, value
    raise ConfigError(
        f"--model {ref!r} takes {len(params)} parameters: a graph model_fn takes "
        "(staged, schema), a Keras build function takes (schema)"
    )


def building(ref: str, build: Callable[..., Any], *args: Any) -> Any:
    """Call the user's model code, turning any failure into a ``ConfigError`` naming it."""
    try:
        return build(*args)
    except ConfigError as exc:
        raise ConfigError(f"--model {ref!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - user code may raise anything while building
        raise ConfigError(
            f"--model {ref!r} failed to build: {type(exc).__name__}: {excerpt(str(exc), 200)}"
        ) from None


def trainer(
    options: TrainerOptions,
    observers: Sequence[StepObserver] = (),
    configure_server: Callable[[Any], None] | None = None,
) -> Trainer | KerasTrainer:
    """The trainer for ``options.model``: graph mode for a ``model_fn``, ``model.fit`` for a
    Keras ``build``. ``ConfigError`` if the model cannot be resolved (see ``resolve``)."""
    kind, fn = resolve(options.model)
    if kind == KERAS:
        from stagefeed.consumer.keras_fit.trainer import KerasTrainer

        return KerasTrainer(options, observers, configure_server, build=fn)
    from stagefeed.consumer.graph.trainer import Trainer

    return Trainer(options, observers, configure_server, model_fn=fn)
