"""The trainer for ``--model``: the one place that knows all three trainer kinds.

On top of ``consumer/``: it imports the graph-mode ``Trainer``, ``KerasTrainer`` and
``ClusterTrainer`` (each only when chosen, so only the Keras kinds import Keras), which in turn
import ``consumer.model_ref``, the resolver of ``--model``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from stagefeed.consumer import model_ref

if TYPE_CHECKING:
    from stagefeed.common.options import TrainerOptions
    from stagefeed.common.tf_config import ClusterPlace
    from stagefeed.consumer.run_facts import StepObserver
    from stagefeed.consumer.trainer_base import TrainerBase


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
    model cannot be resolved (see ``model_ref.resolve``)."""
    kind, fn = model_ref.resolve(options.model)
    if kind == model_ref.KERAS and place.in_cluster:  # one worker of a MultiWorkerMirroredStrategy
        from stagefeed.consumer.cluster.trainer import ClusterTrainer

        return ClusterTrainer(options, observers, configure_server, build=fn, place=place)
    if kind == model_ref.KERAS:
        from stagefeed.consumer.keras_fit.trainer import KerasTrainer

        return KerasTrainer(options, observers, configure_server, build=fn, place=place)
    from stagefeed.consumer.cluster.strategy import refuse_in_cluster

    refuse_in_cluster(f"graph mode (--model {options.model!r})", place)
    from stagefeed.consumer.graph.trainer import Trainer

    return Trainer(options, observers, configure_server, model_fn=fn, place=place)
