"""Child process of the test_cluster_* tests: one trainer worker of a loopback cluster.

``python -m tests.helpers.cluster_child '{json settings}'`` with ``TF_CONFIG`` set (or without, for
``"reference": true``: one process training the same steps on the workers' batches put
together, the figures the cluster must match). Settings: ``runs`` (a list of run settings,
trained one after the other by the same cluster, each with a model of its own),
``timeout_s`` (collectives) and ``heartbeat_s``. Prints ``RUN r`` when run ``r`` starts,
``STEP n loss`` after each step and one ``RESULT {json}`` line at the end of each run (with its
``run`` and its exit ``code``); the process exits with the last run's code. Runs share one
cluster because starting one costs two TensorFlow processes: a run ends in a verdict both
workers reach at the same step, so the next starts in step on both.

Run settings: ``steps`` (budget, 0: none), ``batch`` (per worker, may differ between workers),
``end_at`` (this worker's data has that many batches), ``stop_at`` (vote STOP once that many
steps are done), ``nan_at`` (the batch of that step, 1-based, holds a NaN), ``step_sleep``
(seconds after each step), ``stall_at`` and ``stall_s`` (sleep that long after that step).
A ``NonFiniteLoss`` is reported in the result (code 4); a ``BrokenError`` (the cluster lost a
worker) too (code 3), and it ends the runs: a broken cluster trains nothing more.
``"feed": true``: the worker's batches go through its own stagefeed ``Feed`` (a filler thread
enqueues them and closes the feed after ``end_at``), read with ``feed.dataset(strategy=...)``
and booked step by step, as the trainer will.
SIGTERM sets the local stop of the run in progress, as the trainer's signal handling does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

SETTINGS = json.loads(sys.argv[1])

if not SETTINGS.get("reference"):
    # The strategy is made first: collectives must be configured before any TensorFlow op.
    from stagefeed.common.tf_config import place
    from stagefeed.consumer.cluster.strategy import make_cluster

    CLUSTER = make_cluster(
        place(), timeout_s=SETTINGS.get("timeout_s"), heartbeat_s=SETTINGS.get("heartbeat_s")
    )

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from stagefeed.common.errors import BrokenError, NonFiniteLoss  # noqa: E402
from stagefeed.consumer.run_end import Ending  # noqa: E402

WEIGHTS = np.array([1.0, -1.0, 2.0, 0.5], np.float32)
STOP = threading.Event()


def batch(worker: int, step: int, size: int, nan: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``worker``'s batch of step ``step`` (0-based): the same in every process."""
    x = np.random.default_rng([worker, step]).normal(size=(size, 4)).astype(np.float32)
    y = (x @ WEIGHTS > 0).astype(np.int32)
    if nan:
        x[0, 0] = np.nan
    return x, y


def build() -> keras.Model:
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(2)])  # fmt: skip
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
    )
    return model


def dataset(run: dict, worker: int, size: int) -> tf.data.Dataset:
    end_at, nan_at = run.get("end_at"), run.get("nan_at")

    def make(step: int) -> tuple[np.ndarray, np.ndarray]:
        return batch(worker, int(step), size, nan=nan_at is not None and int(step) + 1 == nan_at)

    steps = tf.data.Dataset.range(end_at) if end_at is not None else tf.data.Dataset.range(2**40)
    if end_at is None:
        steps = steps.repeat()  # infinite: collective_stop.distribute makes it finite
    return steps.map(
        lambda s: tf.numpy_function(make, [s], (tf.float32, tf.int32)), deterministic=True
    ).map(lambda x, y: (tf.ensure_shape(x, (size, 4)), tf.ensure_shape(y, (size,))))


def feed_iterator(run: dict, strategy: tf.distribute.Strategy, worker: int, size: int):
    """The worker's batches through a ``Feed``: (iterator, feed, filler)."""
    from examples.filler import ThreadFiller
    from stagefeed.common.schema import ArraySpec, Schema
    from stagefeed.consumer.tf2.feed import Feed

    schema = Schema((ArraySpec("x", "float32", (4,)), ArraySpec("y", "int32", ())), size)
    feed = Feed(schema, 4, stage_depth=1)
    end_at, nan_at = run.get("end_at"), run.get("nan_at")
    steps = range(end_at) if end_at is not None else iter(int, 1)  # endless without end_at

    def batches():
        for step, _ in enumerate(steps):
            x, y = batch(worker, step, size, nan=nan_at is not None and step + 1 == nan_at)
            yield {"x": x, "y": y}

    filler = ThreadFiller(feed, batches()).start()
    return iter(feed.dataset(("x", "y"), strategy=strategy)), feed, filler


def weights(model: keras.Model) -> list[list[float]]:
    return [np.asarray(w).ravel().tolist() for w in model.get_weights()]


def reference(run: dict) -> dict:
    """One process, no strategy: each step trains on every worker's batch put together."""
    model = build()
    sizes = run["batch"] if isinstance(run["batch"], list) else [run["batch"]] * 2
    losses, history = [], []
    for step in range(run["steps"]):
        parts = [batch(w, step, size) for w, size in enumerate(sizes)]
        x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        logs = model.train_on_batch(x, y, return_dict=True)  # Keras' own step
        losses.append(float(logs["loss"]))
        history.append({name: float(value) for name, value in logs.items()})
    return {"weights": weights(model), "losses": losses, "history": history}


def worker(run: dict) -> dict:
    from stagefeed.consumer.cluster.collective_stop import distribute
    from stagefeed.consumer.cluster.loop import train

    strategy = CLUSTER.strategy
    size = run["batch"]
    if isinstance(size, list):
        size = size[CLUSTER.index]
    with strategy.scope():
        model = build()
    initial = weights(model)
    feed = None
    if run.get("feed"):
        iterator, feed, filler = feed_iterator(run, strategy, CLUSTER.index, size)
        feed.books.begin()
    else:
        iterator = iter(distribute(strategy, lambda context: dataset(run, CLUSTER.index, size)))
    losses: list[float] = []
    history: list[dict] = []
    step_times: list[float] = []
    stop_at = run.get("stop_at")

    def local() -> Ending:
        if stop_at is not None and len(losses) >= stop_at:
            return Ending.STOP
        return Ending.STOP if STOP.is_set() else Ending.RUNNING

    def after_step(step: int, step_figures: dict[str, float]) -> None:
        losses.append(step_figures["loss"])
        history.append(step_figures)
        if feed is not None:
            feed.books.step_done()
        step_times.append(time.time())
        print(f"STEP {step} {step_figures['loss']} {time.time():.2f}", flush=True)
        if not np.isfinite(step_figures["loss"]):
            raise NonFiniteLoss(step, step_figures["loss"])
        time.sleep(run.get("step_sleep", 0))
        if step == run.get("stall_at"):
            time.sleep(run["stall_s"])

    result: dict = {"index": CLUSTER.index, "chief": CLUSTER.chief, "replicas": CLUSTER.replicas,
                    "initial": initial}  # fmt: skip
    try:
        end = train(strategy, model, iterator, steps=run.get("steps", 0), local=local,
                    after_step=after_step)  # fmt: skip
        result.update(steps=end.steps, ending=end.verdict.ending.name, reason=end.verdict.reason,
                      votes=[v.name for v in end.verdict.votes])  # fmt: skip
    except NonFiniteLoss as exc:
        result.update(steps=len(losses), non_finite=str(exc), ending="FAIL")
    except BrokenError as exc:
        result.update(steps=len(losses), broken=str(exc), ending="FAIL")
    if feed is not None:
        feed.books.end()
        del iterator
        filler.stop()
        figures = feed.figures()
        result["feed"] = {"enqueued": figures.enqueued, "trained": figures.trained,
                          "abandoned": figures.abandoned, "queued": figures.queued}  # fmt: skip
    result.update(losses=losses, history=history, weights=weights(model),
                  step_times=step_times, ended_at=time.time())  # fmt: skip
    return result


def code_of(result: dict) -> int:
    return 4 if "non_finite" in result else 3 if "broken" in result else 0


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    code = 0
    for index, run in enumerate(SETTINGS["runs"]):
        print(f"RUN {index}", flush=True)
        result = reference(run) if SETTINGS.get("reference") else worker(run)
        code = code_of(result)
        print("RESULT " + json.dumps({**result, "run": index, "code": code}), flush=True)
        if "broken" in result:
            break
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    code = main()
    if os.environ.get("CLUSTER_CHILD_HARD_EXIT"):
        os._exit(code)
    sys.exit(code)
