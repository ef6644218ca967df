"""What a run shows: figures, the monitor, advice, progress, TensorBoard, Prometheus and the
summary.
"""
