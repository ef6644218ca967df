"""Shared layer: wire protocol, batch spec, options, metrics.

Imports neither producer nor consumer.
"""
