"""Producer sources the benchmarks name with ``--source``; numpy only (producers never load TF).

``labels_in_place`` is the *filled in place* case of ``bench ingest``: a filling source whose
``fill`` writes each batch's labels into the slot it is given and leaves the images as the
slot holds them. Over shared memory nothing else touches the batch on the producer side, so a
measurement with it is the transport's own cost (descriptor, credit, commit, release), the
figure a source that decodes straight into its slot adds its decoding to. It is a benchmark
instrument, not a data source: the images it sends are whatever an earlier batch left.
"""

from __future__ import annotations

import numpy as np

from stagefeed.common.schema import Schema
from stagefeed.producer.sources import WorkerInfo

LABELS_IN_PLACE = "stagefeed.bench.sources:labels_in_place"


class LabelsInPlace:
    """Writes ``labels`` (a counter, within the array's bounds) and nothing else."""

    def __init__(self, schema: Schema, worker: WorkerInfo) -> None:
        spec = schema["labels"]
        self.low, self.high = spec.bounds if spec.bounds is not None else (0, 2**31 - 1)
        self.count = worker.index

    def fill(self, out: dict[str, np.ndarray]) -> bool:
        labels = out["labels"]
        span = self.high - self.low
        labels[...] = self.low + (self.count + np.arange(labels.size).reshape(labels.shape)) % span
        self.count += 1
        return True


def labels_in_place(schema: Schema, worker: WorkerInfo) -> LabelsInPlace:
    return LabelsInPlace(schema, worker)
