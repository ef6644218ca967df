"""Graph mode's model format for ``consumer.checkpoints``: ``tf.compat.v1.train.Saver``.

What is written (every variable of the model's graph, the optimizer's slots included)::

    DIR/checkpoints/model.ckpt-STEP.{index,data-*,meta}   every N steps (all kept)
    DIR/model.ckpt.{index,data-*,meta}                      at the end of training

plus TensorFlow's ``checkpoint`` index file in each directory. Restore with
``tf.compat.v1.train.Saver().restore(session, "DIR/model.ckpt")`` in a graph built by the same
``model_fn`` (or ``tf.compat.v1.train.import_meta_graph("DIR/model.ckpt.meta")``). A checkpoint,
not a SavedModel: the graph's inputs are the feed's queue and staging ops, which a serving
signature could not use; a model for serving is the Keras path's ``model.keras``.
"""

from __future__ import annotations

import glob
import os

import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.consumer.checkpoints import ModelFormat

v1 = tf.compat.v1

FINAL = "model.ckpt"
KEEP = 1 << 20  # "all": with None, TensorFlow logs each checkpoint as untracked


def saver_format(session: v1.Session, save_dir: str) -> ModelFormat:
    """The session's variables through one ``Saver`` (a graph without variables is a
    ``ConfigError`` naming ``save_dir``)."""
    with session.graph.as_default():
        if not v1.global_variables():
            raise ConfigError(f"--save {save_dir!r}: the model has no variables to save")
        saver = v1.train.Saver(max_to_keep=KEEP)

    def save(prefix: str) -> list[str]:
        with session.graph.as_default():
            written = saver.save(session, prefix)
        return [os.path.basename(path) for path in glob.glob(glob.escape(written) + ".*")]

    def restore(prefix: str) -> None:
        try:
            with session.graph.as_default():
                saver.restore(session, prefix)
        except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as exc:
            first = _reason(exc)
            raise ConfigError(
                f"cannot restore {prefix} into this --model (another model's checkpoint?): "
                f"{first}; pass --fresh to start over"
            ) from None
        except (tf.errors.OpError, ValueError) as exc:  # a file damaged inside (DataLossError)
            first = _reason(exc)
            raise ConfigError(
                f"cannot restore checkpoint {prefix}: {type(exc).__name__}: {first}; pass "
                "--fresh to start over"
            ) from None

    return ModelFormat(
        final=FINAL, at_step=lambda step: f"{FINAL}-{step}", save=save, restore=restore
    )


# Lines of a graph execution error that say where, not what.
_WHERE = ("Graph execution error", "Detected at node", "File ", "Node:", "[[", "Original stack")


def _reason(exc: Exception) -> str:
    """The line of ``exc`` that says what went wrong (a graph execution error's first line
    only says that there was one)."""
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    said = [line for line in lines if line and not line.startswith(_WHERE)]
    return (said or lines or [type(exc).__name__])[0][:200]
