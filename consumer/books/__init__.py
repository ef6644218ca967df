"""The trainer's books of what it received and trained: the ledger of batches per connection
(``ledger.py``, its counters in ``books.py``), sequence accounting per connection
(``sequence.py``) and the per-shard books of trained steps that make the input position of exact
resume (``shard_books.py``). Only the trainer keeps them; a producer imports none."""
