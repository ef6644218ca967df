"""Messages a hostile or broken peer could send the trainer (wire protocol v2), and the peers.

- ``wire``: the message builders. Each returns the frames of one ZeroMQ multipart message as a
  DEALER sends it (the trainer's ROUTER adds the routing id). ``good_frames`` is the real
  encoder's output (``common.protocol.encode_batch``); the others bend one thing at a time.

Peers, all real ZeroMQ connections:

- ``peers.Peer``: a DEALER that speaks v2 from the test: hello, credit accounting, verdicts.
- ``good_producer.GoodPeer`` (``python -m tests.hostile good-peer``): a v2 good producer in its
  own process. It says hello, adopts the trainer's schema and sends valid batches against
  credit at a rate, pinging while idle. The hostile tests use it until the real ``stagefeed
  produce`` speaks v2 (``good_producer.start_good_producer`` picks).
- ``peers.RawZmtpPeer``: ZMTP 3.0 with a plain TCP socket, Socket-Type DEALER, so it can
  declare a frame of any size without having the bytes.

``in_flight.stop_with_batch_in_flight`` (``python -m tests.hostile stop-in-flight``): an
in-process intake closed while a batch is in flight.
"""
