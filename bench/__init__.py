"""``stagefeed bench``: the seed's table (``steps``), the feed path's capacity (``ingest``), two
trainer workers (``cluster``) and a decode-bound pipeline against its peers (``input``).

Every figure printed is measured in the same run as the peer it is compared with.
"""
