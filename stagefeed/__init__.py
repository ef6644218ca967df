"""stagefeed: feed a TensorFlow trainer from Python producer processes.

The public API is what ``__all__`` lists; every other module is internal. Producers import
this package without TensorFlow: ``Producers`` and ``WorkerBook`` (producer processes, what
``stagefeed produce`` runs), the ``--model`` marks ``graph_model`` / ``keras_model``, the
input position a custom loop saves and resumes from (``InputPosition``, docs/resume.md) and the
trainer-side names (``Feed``, ``ServedFeed``, ``BooksFigures``, ``TrainedStep``, ``Trainer``,
``KerasTrainer``, ``ClusterTrainer``, ``StepRecord``, ``StepObserver``, ``cast_layer`` and
``keep_freed_memory``), and the built-in data sources (``MapSource`` over ``ArrayRecords``,
``open_npy``, ``open_npz``, ``ImageFolder``, ``ParquetRecords``, ``HFRecords``: docs/data.md)
are loaded on first use (PEP 562); of those only ``Feed``,
``ServedFeed``, ``BooksFigures``, ``TrainedStep``, ``Trainer``, ``KerasTrainer``,
``ClusterTrainer`` and ``cast_layer`` import TensorFlow.

Layers, lowest first: ``stagefeed.common`` (wire protocol, schema, options) <-
``stagefeed.producer`` (never TensorFlow) and ``stagefeed.consumer`` (TensorFlow) <- the CLI
(``stagefeed.cli``, ``stagefeed.launcher``) and ``stagefeed.bench``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # what the lazy names below are, for a type checker (py.typed): not run
    from stagefeed.common.position import InputPosition
    from stagefeed.consumer.cluster.trainer import ClusterTrainer
    from stagefeed.consumer.graph.trainer import Trainer
    from stagefeed.consumer.keras_fit.callback import cast_layer
    from stagefeed.consumer.keras_fit.trainer import KerasTrainer
    from stagefeed.consumer.memory.malloc_policy import keep_freed_memory
    from stagefeed.consumer.model_ref import graph_model, keras_model
    from stagefeed.consumer.run_facts import StepObserver, StepRecord
    from stagefeed.consumer.tf2.feed import Feed
    from stagefeed.consumer.tf2.served_feed import ServedFeed
    from stagefeed.consumer.tf2.step_books import BooksFigures, TrainedStep
    from stagefeed.producer.data.arrays import ArrayRecords, open_npy
    from stagefeed.producer.data.hf import HFRecords
    from stagefeed.producer.data.images import ImageFolder
    from stagefeed.producer.data.npz import open_npz
    from stagefeed.producer.data.parquet import ParquetRecords
    from stagefeed.producer.data.source import MapSource
    from stagefeed.producer.pool import Producers, WorkerBook

__version__ = "0.2.0"

# Trainer-side names: imported (with TensorFlow) only when first used.
_LAZY = {
    # The built-in data sources (docs/data.md): no TensorFlow; their readers' extras on use.
    "ArrayRecords": "stagefeed.producer.data.arrays",
    "HFRecords": "stagefeed.producer.data.hf",
    "ImageFolder": "stagefeed.producer.data.images",
    "MapSource": "stagefeed.producer.data.source",
    "ParquetRecords": "stagefeed.producer.data.parquet",
    "open_npy": "stagefeed.producer.data.arrays",
    "open_npz": "stagefeed.producer.data.npz",
    "BooksFigures": "stagefeed.consumer.tf2.step_books",
    "ClusterTrainer": "stagefeed.consumer.cluster.trainer",
    "Feed": "stagefeed.consumer.tf2.feed",
    "InputPosition": "stagefeed.common.position",  # no TensorFlow
    "KerasTrainer": "stagefeed.consumer.keras_fit.trainer",
    "Producers": "stagefeed.producer.pool",  # no TensorFlow
    "ServedFeed": "stagefeed.consumer.tf2.served_feed",
    "StepObserver": "stagefeed.consumer.run_facts",  # no TensorFlow
    "StepRecord": "stagefeed.consumer.run_facts",  # no TensorFlow
    "Trainer": "stagefeed.consumer.graph.trainer",
    "TrainedStep": "stagefeed.consumer.tf2.step_books",
    "cast_layer": "stagefeed.consumer.keras_fit.callback",
    "graph_model": "stagefeed.consumer.model_ref",  # no TensorFlow
    "keep_freed_memory": "stagefeed.consumer.memory.malloc_policy",  # no TensorFlow
    "keras_model": "stagefeed.consumer.model_ref",  # no TensorFlow
    "WorkerBook": "stagefeed.producer.pool",  # no TensorFlow
}
_WITH_TENSORFLOW = {
    "BooksFigures", "ClusterTrainer", "Feed", "KerasTrainer", "ServedFeed", "TrainedStep",
    "Trainer", "cast_layer",
}  # fmt: skip

__all__ = [
    "ArrayRecords",
    "ArraySpec",
    "BooksFigures",
    "BrokenError",
    "ClosedError",
    "ClusterTrainer",
    "ConfigError",
    "DEFAULT_SCHEMA",
    "DropReason",
    "Feed",
    "HFRecords",
    "ImageFolder",
    "InputPosition",
    "KerasTrainer",
    "MapSource",
    "NonFiniteLoss",
    "ParquetRecords",
    "ProducerOptions",
    "Producers",
    "ProtocolError",
    "Schema",
    "SchemaMismatch",
    "ServedFeed",
    "StagefeedError",
    "StepObserver",
    "StepRecord",
    "TrainedStep",
    "Trainer",
    "TrainerOptions",
    "WorkerBook",
    "__version__",
    "cast_layer",
    "graph_model",
    "image_schema",
    "keep_freed_memory",
    "keras_model",
    "load_schema",
    "open_npy",
    "open_npz",
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
