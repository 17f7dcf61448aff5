"""HTTP/2 keepalive between the router and its workers.

A link that is cut (a cable, a host's network, a blackholed route) drops packets without a
reset: a Decode stream on it would wait for its next token forever, and the router would
never migrate it. The router's channels ping every KEEPALIVE_S seconds and give a
connection KEEPALIVE_S more for the answer, so a stream on a dead link fails (UNAVAILABLE)
within 2 x KEEPALIVE_S and moves to another worker. The worker acknowledges pings in gRPC's
own threads, so a busy engine does not delay the answer; its server lets clients ping that
often (gRPC's default would close the connection as abusive, `too_many_pings`).
"""

from __future__ import annotations

KEEPALIVE_S = 5

CLIENT_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_permit_without_calls", 0),  # an idle channel's health checks suffice
    ("grpc.http2.max_pings_without_data", 0),
]

# a request's images travel in it (worker.proto's Image): gRPC's 4 MiB default would refuse
# a few photographs; the router's max_body_bytes bounds what it sends
MAX_MESSAGE_BYTES = 256 << 20

SERVER_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
