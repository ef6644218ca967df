"""One ROUTER socket: hello and schema checks, credit, the frame reader, the hand-off to the
enqueue threads, socket events, and the shared-memory gate.
"""
