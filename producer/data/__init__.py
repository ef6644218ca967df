"""Built-in map-style data: record sources, a per-record transform, a seeded sampler.

A *record source* (``records.Records``) has ``len()`` records; ``record(i)`` is record ``i``
as ``{name: ndarray}``. The readers: ``arrays`` (numpy arrays in memory, ``.npy`` files
memory-mapped), ``npz`` (an uncompressed ``.npz``, its members memory-mapped), ``images`` (a
folder of class folders, decoded here), ``parquet`` (read by row group), ``hf`` (a Hugging
Face ``datasets.Dataset``). ``sampler`` draws each epoch's order and gives each shard its
batches; ``transform`` runs ``module:function`` per record with its own seeded generator;
``source.MapSource`` ties them into a *passing*, *seekable* source of the producer's source
contract (``producer.sources``); ``open`` builds one from ``--source KIND:PATH``.

Never imports TensorFlow; Pillow, simplejpeg, pyarrow and datasets are imported only by the
reader that needs them (optional extras: ``stagefeed[images]``, ``[parquet]``, ``[hf]``).
"""
