"""One ROUTER socket: hello and schema checks, credit, the frame reader, the hand-off to the
enqueue threads, socket events, the shared-memory gate, what each message does (``dispatch``),
the pass books (``passes``) and the shard rules (``claims``).
"""
