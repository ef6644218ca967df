"""A Keras ``--model``: the built model checked against the schema, and how the schema's arrays
become ``fit``'s ``(x, y)``.

The convention (docs/tf2.md, "The command line with a Keras model"):

- **x, by name.** Every input of the model is a ``keras.Input(shape, name=ARRAY, dtype=...)``
  naming an array of the schema, with that array's per-example shape (``None`` accepts any
  size; the batch dimension is ``None`` or the schema's batch size). Its dtype says where the
  array's declared ``cast``/``scale`` runs: an input of the cast dtype (``cast or dtype``)
  gets the array cast and scaled by the feed, in tf.data on the host; an input of the wire
  dtype, when a cast is declared, gets the array as it travels and the model casts it on the
  device (``consumer.keras_fit.callback.cast_layer``, the first layer). One input: x is that tensor;
  several: a dict by name.
- **y, by flag or by elimination.** ``--targets a,b`` names the target arrays; by default
  they are every array of the schema that is not an input, in schema order. There must be
  one per model output; one target is a tensor, several a tuple in the outputs' order. The
  feed applies their declared cast and scale.
- **Compiled.** ``build(schema)`` returns a ``keras.Model`` on which ``compile(optimizer,
  loss, ...)`` was called; ``fit`` trains it.

A model that breaks any of this is a ``ConfigError`` naming the model and the mismatch, raised
before the feed binds and before any producer is started.

Then the step itself (``check_step``), still before the feed binds: the compiled loss against
the targets' declared bounds (a sparse categorical crossentropy whose output has fewer classes
than the labels' ``[low, high)`` would fail at the first batch on a CPU and train on garbage on
a GPU), and one training step's forward pass and loss traced, not run, on the schema's batch
shapes (an output of the wrong shape for its target). A step that fails in ``fit`` all the
same ends the run like any other failure (``model_ref.step_failed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.consumer.cast import cast_arrays
from stagefeed.consumer.model_ref import said


@dataclasses.dataclass(frozen=True)
class KerasPlan:
    """What the feed hands ``fit``: ``inputs`` and ``targets`` by array name, and the arrays
    the feed casts and scales itself (``cast_by_feed``; the others travel as they are)."""

    schema: Schema
    inputs: tuple[str, ...]
    targets: tuple[str, ...]
    cast_by_feed: tuple[str, ...]

    def mapping(self) -> Callable[[dict[str, tf.Tensor]], tuple[Any, Any]]:
        """The dataset's element function: the dict of wire arrays -> ``(x, y)``."""
        schema, cast = self.schema, self.cast_by_feed
        inputs, targets = self.inputs, self.targets

        def element(batch: dict[str, tf.Tensor]) -> tuple[Any, Any]:
            batch = {**batch, **cast_arrays(schema, {name: batch[name] for name in cast})}
            x = batch[inputs[0]] if len(inputs) == 1 else {n: batch[n] for n in inputs}
            y = batch[targets[0]] if len(targets) == 1 else tuple(batch[n] for n in targets)
            return x, y

        return element


def check_model(
    ref: str, model: Any, schema: Schema, targets: Sequence[str] | None = None
) -> KerasPlan:
    """The plan for ``model`` built by ``--model ref``; ``ConfigError`` naming what is wrong."""

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"--model {ref!r}: {why}")

    if not isinstance(model, keras.Model):
        raise refuse(f"build(schema) returned a {type(model).__name__}, not a keras.Model")
    if not getattr(model, "compiled", False) or getattr(model, "loss", None) is None:
        raise refuse("the model is not compiled with a loss: call model.compile(optimizer, loss)")
    try:
        inputs = list(model.inputs)
        outputs = list(model.outputs)
    except (AttributeError, ValueError):
        inputs = outputs = []
    if not inputs:
        raise refuse(
            "the model has no inputs to match the schema's arrays: build it from "
            "keras.Input(shape, name=ARRAY)"
        )
    cast_by_feed = []
    for tensor in inputs:
        spec = _input_spec(refuse, tensor, schema)
        if _dtype(tensor) == (spec.cast or spec.dtype):
            cast_by_feed.append(spec.name)
    names = tuple(t.name for t in inputs)
    if targets is None:
        targets = tuple(n for n in schema.names if n not in names)
    targets = tuple(targets)
    if overlap := [t for t in targets if t in names]:
        raise refuse(f"array {overlap[0]!r} cannot be both an input and a target")
    if len(targets) != len(outputs):
        raise refuse(
            f"{len(outputs)} outputs but {len(targets)} target arrays {list(targets)} "
            "(name them with --targets)"
        )
    return KerasPlan(schema, names, targets, tuple(cast_by_feed) + targets)


def _input_spec(refuse: Callable[[str], ConfigError], tensor: Any, schema: Schema) -> ArraySpec:
    """The schema's array that input ``tensor`` names, once its shape and dtype fit."""
    name = tensor.name
    if name not in schema.names:
        raise refuse(
            f"input {name!r} is not an array of the schema {list(schema.names)} "
            "(inputs match arrays by name: keras.Input(shape, name=ARRAY))"
        )
    spec = schema[name]
    shape = tuple(tensor.shape)
    per_example = shape[1:]
    fits = len(per_example) == len(spec.shape) and all(
        got is None or got == want for got, want in zip(per_example, spec.shape, strict=True)
    )
    if not fits or shape[0] not in (None, schema.batch_size):
        raise refuse(
            f"input {name!r} has shape {list(shape)}, the array is "
            f"{[schema.batch_size, *spec.shape]}"
        )
    accepted = {spec.dtype, spec.cast or spec.dtype}
    if _dtype(tensor) not in accepted:
        raise refuse(
            f"input {name!r} is {_dtype(tensor)}; the array is {spec.dtype} on the wire"
            + (f", cast to {spec.cast}" if spec.cast else "")
            + f": give the input dtype {' or '.join(sorted(accepted))}"
        )
    return spec


def _dtype(tensor: Any) -> str:
    return str(getattr(tensor.dtype, "name", tensor.dtype))


def check_step(ref: str, model: keras.Model, plan: KerasPlan, strategy: Any = None) -> None:
    """``ConfigError`` naming the model if its compiled loss cannot take the targets' declared
    values, or if one training step on the schema's batch shapes cannot be traced (forward
    pass and loss; nothing runs, no weight or counter moves). Under a ``strategy`` (a cluster
    worker's model, built in its scope) the step is traced in ``strategy.run``, as the
    cluster's step runs it: one replica's batch is the schema's, and a trace runs no
    collective (every worker traces the same, in the same order)."""

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"--model {ref!r}: {why}")

    schema = plan.schema
    _check_targets(refuse, model, [schema[t] for t in plan.targets])
    wire = {
        spec.name: tf.TensorSpec(schema.batch_shape(spec), spec.dtype, name=spec.name)
        for spec in schema.arrays
    }
    element = plan.mapping()

    def split(batch: dict[str, tf.Tensor]) -> tuple[Any, Any, None]:
        x, y = element(batch)
        return x, y, None

    _trace(refuse, model, split, wire, "the schema's batch", strategy)


def check_fit(model: Any, element_spec: Any, targets: Sequence[ArraySpec] | None = None) -> None:
    """For ``Feed.check_model``: ``ConfigError`` naming ``model`` if it is not a compiled
    ``keras.Model``, if its loss cannot take ``targets``' declared values (the arrays of y, one
    per output; None: not known), or if one training step on elements of ``element_spec``
    (the dataset's ``(x, y[, sample_weight])``; None: not traced) cannot be traced."""
    name = getattr(model, "name", type(model).__name__)

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"model {name!r}: {why}")

    if not isinstance(model, keras.Model):
        raise refuse(f"a {type(model).__name__}, not a keras.Model")
    if not getattr(model, "compiled", False) or getattr(model, "loss", None) is None:
        raise refuse("not compiled with a loss: call model.compile(optimizer, loss)")
    if targets is not None and len(targets) == len(model.outputs):
        _check_targets(refuse, model, targets)
    if element_spec is not None:
        split = keras.utils.unpack_x_y_sample_weight
        _trace(refuse, model, split, element_spec, "the dataset's elements")


def _trace(
    refuse: Callable[[str], ConfigError], model: keras.Model,
    split: Callable[[Any], tuple[Any, Any, Any]], specs: Any, what: str, strategy: Any = None,
) -> None:  # fmt: skip
    """Trace, not run, the forward pass and loss of one training step on ``specs`` (``what``
    they are); ``split`` makes an element ``(x, y, sample_weight)``. With a ``strategy``, in
    its replica context (``strategy.run``)."""

    def step(element: Any) -> Any:
        x, y, weights = split(element)
        y_pred = model(x, training=True)
        return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=weights)

    traced = step if strategy is None else lambda element: strategy.run(step, args=(element,))
    try:
        # What the step would assign is kept apart, not applied; the error is said below.
        with keras.StatelessScope(), _without_coordinator_report():
            tf.function(traced, autograph=False).get_concrete_function(specs)
    except Exception as exc:  # noqa: BLE001 - the user's model and loss may raise anything
        raise refuse(f"one training step on {what} fails: {said(exc)}") from None


@contextlib.contextmanager
def _without_coordinator_report() -> Iterator[None]:
    """Without the record (and traceback) TensorFlow's ``Coordinator`` logs for an exception
    in ``strategy.run``'s replica function: the check says that exception in one line."""

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Error reported to Coordinator")

    tf_log = logging.getLogger("tensorflow")
    tf_log.addFilter(keep)
    try:
        yield
    finally:
        tf_log.removeFilter(keep)


def _check_targets(
    refuse: Callable[[str], ConfigError], model: keras.Model, targets: Sequence[ArraySpec]
) -> None:
    for index, (spec, loss) in enumerate(zip(targets, _losses(model), strict=True)):
        _check_classes(refuse, model, index, spec, loss)


def _losses(model: keras.Model) -> list[Any]:
    """The compiled loss of each output, in the outputs' order (None: none, or not known)."""
    loss, names = model.loss, _output_names(model)
    if isinstance(loss, dict):
        return [loss.get(name) for name in names]
    if isinstance(loss, list | tuple):
        return list(loss) + [None] * (len(names) - len(loss))
    return [loss] * len(names)


def _check_classes(
    refuse: Callable[[str], ConfigError], model: keras.Model, index: int, spec: ArraySpec,
    loss: Any,
) -> None:  # fmt: skip
    """A sparse categorical crossentropy: the labels' bounds within the output's classes."""
    if spec.bounds is None or not _is_sparse_crossentropy(loss):
        return
    classes = model.outputs[index].shape[-1]
    if classes is None:
        return
    low, high = spec.bounds
    ignored = getattr(loss, "ignore_class", None)  # a label the loss skips may lie outside
    if ignored is not None and ignored == low:
        low += 1
    if ignored is not None and ignored == high - 1:
        high -= 1
    if low < 0 or high > classes:
        raise refuse(
            f"output {_output_names(model)[index]!r} has {classes} classes, but the target "
            f"{spec.name!r} is in [{spec.bounds[0]}, {spec.bounds[1]}) (the schema's bounds): "
            f"sparse categorical crossentropy needs labels in [0, {classes}); give the output "
            f"{spec.bounds[1]} units or narrow the bounds"
        )


def _is_sparse_crossentropy(loss: Any) -> bool:
    if isinstance(loss, str):
        return loss in ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy")
    function = keras.losses.sparse_categorical_crossentropy
    return (
        isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
        or loss is function
        or getattr(loss, "fn", None) is function
    )


def _output_names(model: keras.Model) -> list[str]:
    """The outputs' names as ``compile(loss={...})`` keys them: their layers' names."""
    return list(getattr(model, "output_names", None) or [t.name for t in model.outputs])
