"""The user's program of the matrix's ServedFeed columns: what docs/tf2.md tells a user to write.

``python -m tests.matrix.feed_user --mode loop|fit --bind ENDPOINT --transport zmq|shm --save DIR
[--model counter|wrong]``

- ``loop``: a ``tf.function`` step counting rows; every ``CHECKPOINT_EVERY`` steps it saves the
  counts, then ``feed.position()`` (docs/resume.md, "A custom loop"), and tells the feed
  (``saved``); a later run resumes from them; at the end of the data it saves the final
  position as finished; run again on it, the feed refuses it (one line, exit 2).
- ``fit``: ``model.fit(feed.dataset(...), epochs=PASSES)`` with ``feed.callback()``; the counts
  are saved at the end (no position: a fit on a ServedFeed does not resume).
Ctrl-C (KeyboardInterrupt) leaves the ``with`` block, which closes the feed; the program then
logs ``interrupted`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import numpy as np

import stagefeed
from tests.helpers import row_counters
from tests.matrix import data

CHECKPOINT_EVERY = 4
log = logging.getLogger("feed_user")


def _write(path: str, write) -> None:
    with open(path + ".tmp", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _checkpoint(save: str, counts: np.ndarray, position: stagefeed.InputPosition,
                step: int) -> None:  # fmt: skip
    """The model first, in a file of its own, then the checkpoint naming it with the position
    (as the CLI's state files do): a kill between the two leaves the previous checkpoint whole.
    ``counts.npy`` is the newest model, for the test to read."""
    name = f"counts-{os.getpid()}-{step}.npy"  # never a file an earlier checkpoint names
    _write(os.path.join(save, name), lambda f: np.save(f, counts))
    body = json.dumps({"counts": name, "position": position.to_dict()}).encode()
    _write(os.path.join(save, "position.json"), lambda f: f.write(body))
    _write(os.path.join(save, "counts.npy"), lambda f: np.save(f, counts))


def _options(args) -> stagefeed.TrainerOptions:
    return stagefeed.TrainerOptions(
        bind=args.bind, schema=data.SCHEMA, queue_mb=1, transport=args.transport,
        shm_producers=3, producer_timeout_s=4, epochs=data.PASSES,
    )  # fmt: skip


def loop(args) -> int:
    import tensorflow as tf

    os.makedirs(args.save, exist_ok=True)
    saved = os.path.join(args.save, "position.json")
    resume = None
    counts = tf.Variable(tf.zeros([data.ROWS]))
    if os.path.exists(saved):
        with open(saved) as f:
            checkpoint = json.load(f)
        resume = stagefeed.InputPosition.from_dict(checkpoint["position"], saved)
        counts.assign(np.load(os.path.join(args.save, checkpoint["counts"])))
        log.info("resuming from %s", saved)

    @tf.function
    def step(batch):
        counts.assign_add(tf.reduce_sum(tf.one_hot(batch["ids"], data.ROWS), axis=0))
        tf.numpy_function(row_counters.sleep_for, [tf.constant(data._step_pause())], tf.float32)

    steps = 0
    try:
        feed = stagefeed.ServedFeed(_options(args), resume=resume, positions=True,
                                    confirm_saves=True)  # fmt: skip
    except stagefeed.ConfigError as exc:  # e.g. the saved position holds a finished run
        log.error("%s", exc)
        return 2
    with feed:
        log.info("listening on %s", feed.endpoint)
        for batch in feed.dataset():
            step(batch)
            feed.books.step_done()
            steps += 1
            if steps % CHECKPOINT_EVERY == 0:
                position = feed.position()
                _checkpoint(args.save, counts.numpy(), position, steps)
                feed.saved(position)
                log.info("step %d: checkpoint", steps)
        feed.check()
        final = feed.position()
        _checkpoint(args.save, counts.numpy(), final, steps)
        feed.saved(final, finished=True)
        log.info("data ended: %d steps trained in this run", steps)
        log.info("%s", feed.ledger.summary())
    return 0


def _progress_callback():
    import keras

    class Progress(keras.callbacks.Callback):
        """Logs every ``CHECKPOINT_EVERY`` batches (what a user's progress bar would show)."""

        def __init__(self) -> None:
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None) -> None:
            self.steps += 1
            if self.steps % CHECKPOINT_EVERY == 0:
                log.info("step %d: trained", self.steps)

    return Progress()


def fit(args) -> int:
    model = data.keras_wrong_output(data.SCHEMA) if args.model == "wrong" else (
        data.keras_counter(data.SCHEMA))  # fmt: skip
    os.makedirs(args.save, exist_ok=True)
    with stagefeed.ServedFeed(_options(args)) as feed:
        log.info("listening on %s", feed.endpoint)
        model.fit(feed.dataset(("ids", "x")), epochs=data.PASSES, verbose=0,
                  callbacks=[feed.callback(), _progress_callback()])  # fmt: skip
        feed.check()
        counts = model.get_layer("counter").counts.numpy()
        _write(os.path.join(args.save, "counts.npy"), lambda f: np.save(f, counts))
        log.info("data ended: fit returned")
        log.info("%s", feed.ledger.summary())
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("loop", "fit"), required=True)
    parser.add_argument("--bind", required=True)
    parser.add_argument("--transport", choices=("zmq", "shm"), default="zmq")
    parser.add_argument("--save", required=True)
    parser.add_argument("--model", choices=("counter", "wrong"), default="counter")
    args = parser.parse_args()
    # Started from a shell, a program has Python's SIGINT handler; started by a pytest-xdist
    # worker it inherits SIGINT ignored, which Python keeps: give it what a shell gives.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    import tensorflow as tf

    log.info("TensorFlow %s loaded in %.1f s", tf.__version__, time.monotonic() - started)
    try:
        return loop(args) if args.mode == "loop" else fit(args)
    except KeyboardInterrupt:
        log.info("interrupted: the feed is closed")
        return 0


if __name__ == "__main__":
    sys.exit(main())
