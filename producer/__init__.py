"""Producer side: processes that make numpy batches and send them to the trainer (protocol v2).

``pool`` starts and supervises worker processes; ``worker`` is one process's job; ``sources``
is the source contract (``synthetic`` in ``synthetic``, buffers in ``buffers``); ``channel``
is the connection to the trainer, whose thread (``link``), conversation (``session``) and
hand-off (``handoff``) sit beside it. Never imports TensorFlow, so producers stay light.
"""
