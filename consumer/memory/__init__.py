"""glibc's heap: the mallinfo2 gauges and the malloc policy (no TensorFlow; the CLI imports it
first).
"""
