"""``--model module:NAME``: what the trainer trains, resolved and checked at start.

Two kinds of model:

- a graph-mode ``model_fn(staged, schema) -> (loss, train_op)``: ``staged`` is a dict of the
  schema's arrays as staged on the training device (cast and scaled as the schema declares);
  it builds its variables and returns the loss tensor and the train op. The seed's AlexNet is
  one (``alexnet``, the default). The staged batch's sequence number and connection index
  are in the graph collections ``consumer.graph.feed_graph.STAGED_SEQ`` / ``STAGED_PEER``.
- a Keras ``build(schema) -> keras.Model``, compiled: trained with ``model.fit`` on the feed's
  ``tf.data.Dataset``.

The kind is told by how the callable can be called, never by counting required parameters:
a callable marked ``@stagefeed.graph_model`` or ``@stagefeed.keras_model`` (the attribute
``stagefeed_model_kind``) is that kind; an unmarked one is the only kind its signature can take
(``build(schema=None)`` can only be a build, ``model_fn(staged, schema)`` only a model_fn).
One that could be either (``model_fn(staged, schema=None)``, ``build(schema, lr=0.1)``) or
neither is refused, naming the marks that settle it. Then what it returns is checked: a
``keras.Model`` (``consumer.keras_fit.model_check``) or a ``(loss, train_op)`` pair.

Any failure (cannot import, not callable, cannot be called as its kind, the model refuses the
schema, an exception while building, a result of the wrong kind, a Keras model that does not
fit the schema) is a ``ConfigError`` naming the model, raised before any producer is started.
A train step that fails later (TensorFlow's error in ``fit`` or ``session.run``) is a
``BrokenError`` naming the model and the first line of what TensorFlow said
(``step_failed``): the run ends as every failure does, the summary, then that line, exit 3.
``trainer()`` makes the trainer of either kind; only the Keras kind imports Keras.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from stagefeed.common.errors import BrokenError, ConfigError, StagefeedError
from stagefeed.common.excerpt import excerpt
from stagefeed.common.refs import import_ref

if TYPE_CHECKING:
    from stagefeed.common.options import TrainerOptions
    from stagefeed.common.tf_config import ClusterPlace
    from stagefeed.consumer.trainer_base import StepObserver, TrainerBase

DEFAULT_MODEL = "alexnet"
GRAPH = "graph"
KERAS = "keras"
KIND_ATTRIBUTE = "stagefeed_model_kind"
# How each kind is called: the arguments a signature must accept.
CALLS = {GRAPH: ("model_fn(staged, schema)", 2), KERAS: ("build(schema)", 1)}
MARKS = "mark it @stagefeed.graph_model or @stagefeed.keras_model"

F = TypeVar("F", bound=Callable[..., Any])


def graph_model(fn: F) -> F:
    """Mark ``fn`` a graph-mode ``model_fn(staged, schema) -> (loss, train_op)`` for ``--model``."""
    setattr(fn, KIND_ATTRIBUTE, GRAPH)
    return fn


def keras_model(fn: F) -> F:
    """Mark ``fn`` a Keras ``build(schema) -> keras.Model`` (compiled) for ``--model``."""
    setattr(fn, KIND_ATTRIBUTE, KERAS)
    return fn


def resolve(ref: str) -> tuple[str, Callable[..., Any]]:
    """(kind, callable) for ``--model``: ``alexnet`` or ``module:NAME`` (see the module doc)."""
    if ref == DEFAULT_MODEL:
        from stagefeed.consumer.graph.alexnet import model_fn

        return GRAPH, _checked_model_fn(model_fn)
    value = import_ref(ref, "--model")
    if not callable(value):
        raise ConfigError(f"--model {ref!r} is a {type(value).__name__}, not a function")
    kind = _kind(ref, value)
    return kind, (_checked_model_fn(value) if kind == GRAPH else value)


def _kind(ref: str, fn: Callable[..., Any]) -> str:
    marked = getattr(fn, KIND_ATTRIBUTE, None)
    if marked is not None and marked not in CALLS:
        raise ConfigError(
            f"--model {ref!r}: {KIND_ATTRIBUTE} is {excerpt(marked, 40)}, not "
            f"{GRAPH!r} or {KERAS!r}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        if marked is not None:
            return str(marked)
        raise ConfigError(f"--model {ref!r}: its parameters cannot be read; {MARKS}") from None
    takes = [kind for kind, (_, count) in CALLS.items() if _binds(signature, count)]
    if marked is not None:
        if marked not in takes:
            call = CALLS[marked][0]
            raise ConfigError(
                f"--model {ref!r} is marked {marked} but cannot be called as {call}: it is "
                f"{_shown(fn, signature)}"
            )
        return str(marked)
    if len(takes) == 1:
        return takes[0]
    signature_text = _shown(fn, signature)
    if takes:
        raise ConfigError(
            f"--model {ref!r}: {signature_text} could be a graph model_fn(staged, schema) or a "
            f"Keras build(schema); {MARKS}"
        )
    raise ConfigError(
        f"--model {ref!r}: {signature_text} is neither a graph model_fn(staged, schema) nor a "
        "Keras build(schema)"
    )


def _shown(fn: Callable[..., Any], signature: inspect.Signature) -> str:
    text = f"{getattr(fn, '__name__', type(fn).__name__)}{signature}"
    return text if len(text) <= 120 else text[:117] + "..."


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


def _checked_model_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, with its result checked to be ``(loss, train_op)`` (a ``ConfigError`` if not)."""

    def model_fn(staged: Any, schema: Any) -> tuple[Any, Any]:
        result = fn(staged, schema)
        if not isinstance(result, tuple | list) or len(result) != 2:
            hint = "; a Keras build? mark it @stagefeed.keras_model" if _is_model(result) else ""
            raise ConfigError(
                f"the graph model_fn returned a {type(result).__name__}, not (loss, train_op)"
                + hint
            )
        return result[0], result[1]

    return model_fn


def _is_model(value: Any) -> bool:
    return callable(getattr(value, "fit", None)) and callable(getattr(value, "compile", None))


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


# The lines of a TensorFlow error around what it says: its heading, where the node was defined.
_TF_CONTEXT = ("Graph execution error:", "Detected at node", "File ", "Node:", "[[")


def said(exc: BaseException, limit: int = 300) -> str:
    """``exc`` in one line: its type and the first line of its message that says something,
    at most ``limit`` characters of it (a TensorFlow error leads with a heading and the
    stack where its node was defined, and runs on with node names and tensor values)."""
    lines = [line.strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line and not line.startswith(_TF_CONTEXT)] or [""]
    first = lines[0]
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def step_failed(ref: str, exc: BaseException) -> StagefeedError:
    """The failure that ends a run whose train step raised ``exc`` (``--model ref``): a
    ``BrokenError`` naming the model; stagefeed's own error (from a callback) as it is."""
    if isinstance(exc, StagefeedError):
        return exc
    return BrokenError(f"--model {ref!r}: a train step failed: {said(exc)}")


def trainer(
    options: TrainerOptions,
    observers: Sequence[StepObserver] = (),
    configure_server: Callable[[Any], None] | None = None,
    *,
    place: ClusterPlace,
) -> TrainerBase:
    """The trainer for ``options.model``: graph mode for a ``model_fn``, ``model.fit`` for a
    Keras ``build``, and for a Keras ``build`` when ``place`` is in a cluster (``TF_CONFIG``,
    resolved once by the caller: ``tf_config.place``), one worker of it
    (``consumer.cluster.trainer``; graph mode is refused there). ``ConfigError`` if the
    model cannot be resolved (see ``resolve``)."""
    kind, fn = resolve(options.model)
    if kind == KERAS and place.in_cluster:  # one worker of a MultiWorkerMirroredStrategy cluster
        from stagefeed.consumer.cluster.trainer import ClusterTrainer

        return ClusterTrainer(options, observers, configure_server, build=fn, place=place)
    if kind == KERAS:
        from stagefeed.consumer.keras_fit.trainer import KerasTrainer

        return KerasTrainer(options, observers, configure_server, build=fn, place=place)
    from stagefeed.consumer.cluster.strategy import refuse_in_cluster

    refuse_in_cluster(f"graph mode (--model {options.model!r})", place)
    from stagefeed.consumer.graph.trainer import Trainer

    return Trainer(options, observers, configure_server, model_fn=fn, place=place)
