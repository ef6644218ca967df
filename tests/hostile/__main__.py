"""``python -m tests.hostile good-peer ...`` (``good_producer.GoodPeer``) or ``stop-in-flight``
(``in_flight.stop_with_batch_in_flight``)."""

from __future__ import annotations

import sys

from tests.hostile.good_producer import good_peer_main
from tests.hostile.in_flight import stop_with_batch_in_flight

if __name__ == "__main__":
    if sys.argv[1:2] == ["stop-in-flight"]:
        sys.exit(stop_with_batch_in_flight())
    if sys.argv[1:2] != ["good-peer"]:
        sys.exit("usage: python -m tests.hostile good-peer --connect ENDPOINT [--name N]")
    sys.exit(good_peer_main(sys.argv[2:]))
