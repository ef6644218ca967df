"""What the tests share and are not tests themselves: process helpers (``procs``, ``peer``,
``standin_trainer``, ``shm_procs``, ``cluster_workers``), the models, schemas and sources named
on test command lines (``resume_models``, ``regression_models``, ``passes_models``,
``run_length_models``, ``model_kinds``, ``model_fit``, ``image_models``, ``user_source``,
``data_user``, ``data_transforms``), child programs run with ``python -m`` (``cluster_child``,
``dataset_mirrored_child``, ``shm_canary``), Hypothesis strategies, the k8s renderer and the
fast-test selection (``fast_tests``)."""
