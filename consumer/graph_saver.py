"""``--save DIR`` and ``--checkpoint-every N`` in graph mode: ``tf.compat.v1.train.Saver``.

What is written (every variable of the model's graph, the optimizer's slots included)::

    DIR/checkpoints/model.ckpt-STEP.{index,data-*,meta}   every N steps (all kept)
    DIR/model.ckpt.{index,data-*,meta}                      at the end of training

plus TensorFlow's ``checkpoint`` index file in each directory. Restore with
``tf.compat.v1.train.Saver().restore(session, "DIR/model.ckpt")`` in a graph built by the same
``model_fn`` (or ``tf.compat.v1.train.import_meta_graph("DIR/model.ckpt.meta")``). A checkpoint,
not a SavedModel: the graph's inputs are the feed's queue and staging ops, which a serving
signature could not use; a model for serving is the Keras path's ``model.keras``.

Lifecycle: ``GraphSaver(graph, directory, every)`` after the model is built (a graph without
variables is a ``ConfigError``) -> ``after_step(session, step)`` each step -> ``final(session,
step)`` once. The directory was checked writable at start (``common.paths``).
"""

from __future__ import annotations

import logging
import os

import tensorflow as tf
from stagefeed.common.errors import ConfigError

log = logging.getLogger(__name__)
v1 = tf.compat.v1

FINAL = "model.ckpt"
CHECKPOINTS = "checkpoints"
KEEP = 1 << 20  # "all": with None, TensorFlow logs each checkpoint as untracked


class GraphSaver:
    """Saves the session's variables: every ``every`` steps (0: never) and at the end."""

    def __init__(self, graph: tf.Graph, directory: str, every: int = 0) -> None:
        self.directory = directory
        self.every = every
        with graph.as_default():
            if not v1.global_variables():
                raise ConfigError(f"--save {directory!r}: the model has no variables to save")
            self._saver = v1.train.Saver(max_to_keep=KEEP)
        if every:
            os.makedirs(os.path.join(directory, CHECKPOINTS), exist_ok=True)

    def after_step(self, session: v1.Session, step: int) -> str | None:
        """A checkpoint if ``step`` is a multiple of ``every``; its path prefix, or None."""
        if not self.every or step % self.every:
            return None
        prefix = os.path.join(self.directory, CHECKPOINTS, FINAL)
        with session.graph.as_default():
            path = self._saver.save(session, prefix, global_step=step)
        log.info("step %d: checkpoint %s", step, path)
        return path

    def final(self, session: v1.Session, step: int) -> str:
        """The trained variables as ``DIR/model.ckpt``; returns that prefix."""
        with session.graph.as_default():
            path = self._saver.save(session, os.path.join(self.directory, FINAL))
        log.info("saved the model after %d steps: %s", step, path)
        return path
