"""The trainer side (TensorFlow lives here): the intake of batches from producers, graph mode
(FIFOQueue -> StagingArea -> model_fn), the TF 2 feed (tf.data with a device buffer), the Keras
``fit`` path, what a run shows, and glibc's heap. The map, one paragraph a package, and what
each may import: ``docs/architecture.md``.
"""
