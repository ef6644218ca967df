"""Several trainers: MultiWorkerMirroredStrategy from TF_CONFIG (``strategy``), a custom
synchronous step for a compiled Keras model (``distributed_step``), the cluster's stop vote
(``collective_stop``) and the loop that ties them (``loop``). docs/scaling.md.
"""
