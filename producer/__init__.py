"""Producer side: processes that generate numpy batches and push them over ZeroMQ.

Never imports TensorFlow, so producers stay light and start fast.
"""
