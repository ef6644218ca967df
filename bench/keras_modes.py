"""The Keras modes of ``bench steps``: ``model.fit`` of one Keras AlexNet on three inputs.

Every mode trains ``bench.keras_model.alexnet`` on the same schema with one ``fit`` call,
stepped by ``bench.keras_gate.GatedFit``. A mode's lifecycle is the graph modes' (``setup()``
-> ``step()`` ... with ``settle()`` after each block -> ``close()``); ``step()`` returns
``(seconds, None)``: the input wait happens inside Keras' traced ``train_function`` and cannot
be told apart from compute there. Numpy batches are made once, in ``setup()``.

- ``keras-synthetic``, the upper bound: one batch made by TF random ops on the training
  device and held there; the model's ``train_step`` trains on it whatever the dataset yields
  (a scalar, ``from_tensors(0).repeat()``). A dataset of the batch itself would not do on a
  GPU: tf.data keeps its elements in host memory, so every step would copy the batch over.
- ``keras-from_generator``, what a TF 2 user picks instead: ``Dataset.from_generator`` over a
  numpy batch + ``prefetch(2)``, + ``prefetch_to_device`` last on a GPU.
- ``keras-stagefeed``: ``bench.keras_stagefeed``.
"""

from __future__ import annotations

import time
from typing import Any

import keras
import tensorflow as tf

from stagefeed.bench.config import StepsConfig
from stagefeed.bench.keras_gate import GatedFit
from stagefeed.bench.keras_model import alexnet, alexnet_layers, compile_model
from stagefeed.bench.modes import TF_DATA_SETTLE_S, generator_dataset

START_TIMEOUT_S = 600.0  # the first step traces the train function
STEP_TIMEOUT_S = 600.0


class KerasMode:
    """A ``model.fit`` on one dataset; subclasses give ``dataset()`` and may change ``model()``."""

    name = ""

    def __init__(self, config: StepsConfig, device: str) -> None:
        self.config = config
        self.schema = config.schema
        self.device = device
        self.fit: GatedFit | None = None

    def model(self) -> keras.Model:
        return alexnet(self.schema)

    def dataset(self) -> tuple[Any, dict[str, Any]]:
        """(what ``fit`` iterates, info for the report)."""
        raise NotImplementedError

    def callbacks(self) -> list[keras.callbacks.Callback]:
        return []

    def setup(self) -> dict[str, Any]:
        with tf.device(self.device):
            model = self.model()
            dataset, info = self.dataset()
        self.fit = GatedFit(self.name, model, dataset, self.device, self.callbacks())
        first = self.fit.start(START_TIMEOUT_S)
        info["first_step_s"] = round(first, 3)  # tracing included
        info["parameters"] = model.count_params()
        return info

    def step(self) -> tuple[float, float | None]:
        assert self.fit is not None
        return self.fit.step(STEP_TIMEOUT_S), None

    def settle(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.fit is not None:
            self.fit.close()


class HeldBatchModel(keras.Model):
    """The Keras AlexNet, trained on a batch held on the device instead of the dataset's
    elements: the same ``train_step`` (forward, loss, gradients, SGD) on other data."""

    held: tuple[tf.Tensor, tf.Tensor] | None = None

    def train_step(self, data: Any) -> Any:
        assert self.held is not None
        return super().train_step(self.held)


class KerasSyntheticMode(KerasMode):
    """Random images (uint8 in [0, 256), float32 truncated-normal(127, 60) as the graph
    synthetic modes make them) and labels, made once by TF ops on the training device."""

    name = "keras-synthetic"

    def model(self) -> keras.Model:
        schema = self.schema
        inputs, logits = alexnet_layers(schema)
        model = compile_model(HeldBatchModel(inputs, logits, name="alexnet"))
        image_shape = schema.batch_shape(schema["images"])
        if schema["images"].dtype == "uint8":
            images = tf.cast(tf.random.uniform(image_shape, 0, 256, dtype=tf.int32), tf.uint8)
        else:
            images = tf.random.truncated_normal(image_shape, mean=127.0, stddev=60.0)
        classes = schema["labels"].bounds[1]
        labels = tf.random.uniform(schema.batch_shape(schema["labels"]), 0, classes, tf.int32)
        model.held = (tf.identity(images), tf.identity(labels))
        return model

    def dataset(self) -> tuple[Any, dict[str, Any]]:
        dataset = tf.data.Dataset.from_tensors(tf.constant(0, tf.int32)).repeat()
        return dataset, {"data_device": self.device}


class KerasFromGeneratorMode(KerasMode):
    """``Dataset.from_generator`` yielding one numpy batch (made once) forever, ``prefetch(2)``;
    ``prefetch_to_device`` on a GPU. The generator's conversion of every batch to a tensor (a
    copy, holding the GIL) is its cost, as in the graph ``tf.data`` mode."""

    name = "keras-from_generator"

    def dataset(self) -> tuple[Any, dict[str, Any]]:
        return generator_dataset(self.schema, self.device)

    def settle(self) -> dict[str, Any]:
        time.sleep(TF_DATA_SETTLE_S)
        return {"slept_s": TF_DATA_SETTLE_S}
