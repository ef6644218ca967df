"""Graph mode (tf.compat.v1): FIFOQueue -> StagingArea -> model_fn, the graph trainer, its Saver
checkpoints, and the seed's AlexNet.
"""
