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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf
from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.consumer.cast import cast_arrays


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
