"""The vocabulary both sides share: the wire protocol, the schema, options, endpoints and CURVE
keys, errors, lifecycle helpers, the ledger of received batches, and shared memory between a
producer and a trainer on one host (``common.shm``).

Imports neither ``producer`` nor ``consumer``, and never TensorFlow (docs/architecture.md).
"""
