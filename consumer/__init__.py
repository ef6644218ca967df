"""Trainer side: receive pool, FIFOQueue, StagingArea and the AlexNet train op (TensorFlow)."""
