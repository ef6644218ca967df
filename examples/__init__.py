"""Runnable examples; each is also run by the test suite (tests/test_examples*.py)."""
