"""``bench input``'s ``pydataset`` mode: a ``keras.utils.PyDataset`` over the Python decode.

A module of its own, importing Keras at its top: ``PyDataset(use_multiprocessing=True)``
pickles the dataset into its worker processes where they are spawned, and they import it from
here by name. Only ``bench.input_keras``'s worker process imports this module.
"""

from __future__ import annotations

from typing import Any

import keras

from stagefeed.bench.input_data import PythonDecode


class DecodedBatches(keras.utils.PyDataset):
    """Batch ``i`` of the endless epochs (``PythonDecode.batch``), decoded in one of
    ``workers`` processes; ``length`` batches in all."""

    def __init__(
        self, folder: str, crop: int, seed: int, batch_size: int, length: int, workers: int
    ) -> None:
        super().__init__(workers=workers, use_multiprocessing=True)
        self.decode = PythonDecode(folder, crop, seed)
        self.batch_size = batch_size
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.decode.batch(index, self.batch_size)
