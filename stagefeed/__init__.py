"""stagefeed: feed a TensorFlow trainer from Python producer processes over ZeroMQ.

Top layer: the command line and the launcher. Imports ``producer`` and ``consumer``; nothing
below imports it.
"""

__version__ = "0.1.0"
