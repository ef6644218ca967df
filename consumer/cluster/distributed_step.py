"""One synchronous train step of a compiled Keras 3 model on every replica of the cluster.

Why not ``model.fit``: under ``MultiWorkerMirroredStrategy`` Keras 3 (3.15, TF 2.21) fails
before the first step (docs/scaling.md has the error), so the cluster trains with this step,
which uses what the user compiled: the model's loss (``model.compute_loss``, regularisation
losses included), its optimizer (``optimizer.apply``) and its compiled metrics
(``model.compute_metrics``).

Per replica, inside ``strategy.run`` in one ``tf.function``: forward pass (``training=True``),
the compiled loss, gradients, ``optimizer.apply`` (whose all-reduce SUMs the gradients across
every replica of every worker), the metrics' update. Loss scaling: Keras' compiled loss is
the replica's mean divided by the number of replicas, exact when every replica has as many
examples; the step multiplies it by ``n_replica * replicas / global_batch`` (``global_batch``
from the stop vote), so that the sum over replicas is the mean over the global batch whatever
the split. The gradients then are those of the global mean: one step on R replicas equals one
step on their batches put together (tested).

Figures, once per step: ``loss``, the step's global mean loss (an all-reduced SUM, so the
same value on every worker: a non-finite loss is seen by every worker at the same step), and
the compiled metrics, reset before the step, so each is the step's own value over the global
batch (metric variables are on-read sums, read across every replica). ``figures()`` turns
them into Python floats.

Elements: what the dataset yields, ``(x, y)`` or ``(x, y, sample_weight)`` as for ``fit``
(``keras.utils.unpack_x_y_sample_weight``). Build and compile the model under
``strategy.scope()``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from stagefeed.common.errors import ConfigError


class DistributedStep:
    """``step(batch, global_batch)`` trains one step; returns the figures as tensors."""

    def __init__(self, strategy: tf.distribute.Strategy, model: keras.Model) -> None:
        if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
            raise ConfigError("the model must be compiled (optimizer and loss) under the scope")
        self.strategy = strategy
        self.model = model
        self.replicas = strategy.num_replicas_in_sync
        self._step = tf.function(self._step_fn)

    def __call__(self, batch: Any, global_batch: int) -> dict[str, tf.Tensor]:
        # Eagerly: Keras' compiled metrics are built by their first update, so a reset traced
        # into the first step would be an empty one, for good.
        self.model.reset_metrics()
        return self._step(batch, tf.constant(global_batch, tf.int32))

    @staticmethod
    def figures(figures: dict[str, tf.Tensor]) -> dict[str, float]:
        """The figures as Python floats (the step has computed them all by then)."""
        return {name: float(value) for name, value in figures.items()}

    def _step_fn(self, batch: Any, global_batch: tf.Tensor) -> dict[str, tf.Tensor]:
        model = self.model
        losses = self.strategy.run(self._replica_step, args=(batch, global_batch))
        loss = self.strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)
        figures = {"loss": loss}
        for name, value in model.get_metrics_result().items():
            if name != "loss":  # Keras' loss tracker: not updated here, the step's loss is above
                figures[name] = value
        return figures

    def _replica_step(self, batch: Any, global_batch: tf.Tensor) -> tf.Tensor:
        model = self.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        size = tf.shape(tf.nest.flatten(x)[0])[0]
        share = tf.cast(size * self.replicas, tf.float32) / tf.cast(global_batch, tf.float32)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            loss = loss * tf.cast(share, loss.dtype)
            scaled = model.optimizer.scale_loss(loss)  # mixed precision's loss scale, else loss
        variables = model.trainable_variables
        model.optimizer.apply(tape.gradient(scaled, variables), variables)
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return loss
