"""The TF 2 feed: an eager FIFOQueue read by tf.data with a device buffer, its per-step books, Feed
and ServedFeed.
"""
