"""Runnable examples of the TF 2 feed: ``python -m examples.NAME`` from the repository root."""
