"""stagefeed: feed a TensorFlow trainer from Python producer processes.

The public API is what ``__all__`` lists; every other module is internal. Producers import
this package without TensorFlow: the trainer-side names (``Feed``, ``ServedFeed``,
``Trainer``, ``KerasTrainer``, ``StepRecord``, ``StepObserver``, ``cast_layer``,
``keep_freed_memory`` and the ``--model`` marks ``graph_model`` / ``keras_model``) are loaded
on first use (PEP 562); all but the step records, ``keep_freed_memory`` and the marks import
TensorFlow.

Layers, lowest first: ``stagefeed.common`` (wire protocol, schema, options) <-
``stagefeed.producer`` (never TensorFlow) and ``stagefeed.consumer`` (TensorFlow) <- the CLI
(``stagefeed.cli``, ``stagefeed.launcher``) and ``stagefeed.bench``.
"""

from __future__ import annotations

import importlib
from typing import Any

from stagefeed.common.errors import (
    BrokenError,
    ClosedError,
    ConfigError,
    DropReason,
    NonFiniteLoss,
    ProtocolError,
    StagefeedError,
)
from stagefeed.common.options import ProducerOptions, TrainerOptions
from stagefeed.common.schema import (
    DEFAULT_SCHEMA,
    ArraySpec,
    Schema,
    SchemaMismatch,
    image_schema,
    load_schema,
)

__version__ = "0.2.0"

# Trainer-side names: imported (with TensorFlow) only when first used.
_LAZY = {
    "Feed": "stagefeed.consumer.tf2.feed",
    "KerasTrainer": "stagefeed.consumer.keras_fit.trainer",
    "ServedFeed": "stagefeed.consumer.tf2.served_feed",
    "StepObserver": "stagefeed.consumer.trainer_base",
    "StepRecord": "stagefeed.consumer.trainer_base",
    "Trainer": "stagefeed.consumer.graph.trainer",
    "cast_layer": "stagefeed.consumer.keras_fit.callback",
    "graph_model": "stagefeed.consumer.model_ref",  # no TensorFlow
    "keep_freed_memory": "stagefeed.consumer.memory.malloc_policy",  # no TensorFlow
    "keras_model": "stagefeed.consumer.model_ref",  # no TensorFlow
}
_WITH_TENSORFLOW = {"Feed", "KerasTrainer", "ServedFeed", "Trainer", "cast_layer"}

__all__ = [
    "ArraySpec",
    "BrokenError",
    "ClosedError",
    "ConfigError",
    "DEFAULT_SCHEMA",
    "DropReason",
    "Feed",
    "KerasTrainer",
    "NonFiniteLoss",
    "ProducerOptions",
    "ProtocolError",
    "Schema",
    "SchemaMismatch",
    "ServedFeed",
    "StagefeedError",
    "StepObserver",
    "StepRecord",
    "Trainer",
    "TrainerOptions",
    "__version__",
    "cast_layer",
    "graph_model",
    "image_schema",
    "keep_freed_memory",
    "keras_model",
    "load_schema",
]
assert __all__ == sorted(__all__), "keep __all__ sorted"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stagefeed' has no attribute {name!r}")
    if name in _WITH_TENSORFLOW:
        from stagefeed.consumer.quiet_tf import import_tensorflow

        import_tensorflow()  # its C++ start-up lines filtered, unless already imported
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
