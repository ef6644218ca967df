"""The training device, chosen one way for every trainer (graph mode, ``Feed``, Keras).

``auto`` is ``/gpu:0`` when TensorFlow sees a GPU, else ``/cpu:0``; ``cpu`` and ``gpu`` name
device 0 of that kind; any other name (``/gpu:1``) is kept as given. ``gpu`` without a GPU
is a ``ConfigError`` at start, never a silent fall-back to the CPU.
"""

from __future__ import annotations

from stagefeed.common.errors import ConfigError

HOST = "/cpu:0"


def training_device(requested: str = "auto") -> str:
    """The device name for ``requested`` (see the module docstring)."""
    if not isinstance(requested, str) or not requested:
        raise ConfigError(
            f"device must be 'auto', 'cpu', 'gpu' or a device name, got {requested!r:.80}"
        )
    import tensorflow as tf  # here: is_gpu and HOST serve processes without TensorFlow

    gpus = tf.config.list_physical_devices("GPU")
    if requested == "gpu" and not gpus:
        raise ConfigError("device 'gpu' requested but TensorFlow sees no GPU")
    if requested == "auto":
        return "/gpu:0" if gpus else HOST
    if requested in ("cpu", "gpu"):
        return f"/{requested}:0"
    return requested


def is_gpu(device: str) -> bool:
    """True for a GPU device name as ``training_device`` returns it."""
    return device.lower().startswith(("/gpu", "/device:gpu"))
