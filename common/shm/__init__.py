"""Shared memory between a producer and a trainer on one host: the pool layout, the producer's
slots, the trainer's read-only map, and descriptor passing.
"""
