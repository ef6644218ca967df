"""``stagefeed bench``: the seed's table (``steps``) and the feed path's capacity (``ingest``).

Every figure printed is measured in the same run as the peer it is compared with.
"""
