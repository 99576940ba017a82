"""Values the controller shares with the processes that launch it.

They live outside ``pathways.controller`` so that a client, which launches local clusters
and names their defaults, does not import the controller to learn them.
"""

ADDRESS_LINE = "PATHWAYS_CONTROLLER_ADDRESS"  # the controller prints it, then its address, once serving
# A controller given --ifrt-bind prints this word, then its IFRT proxy server's grpc://HOST:PORT,
# on the line after its ADDRESS_LINE, in the same write.
IFRT_LINE = "ifrt"
DEFAULT_WINDOW = 8  # runs in flight per island: a client must keep more outstanding for its weight to count
# Seconds of silence after which the controller and a worker judge each other slow (the
# peer's host still acknowledges: kept) or lost (it acknowledges nothing either), see
# wire/liveness.py (each sends something at least every fifth of its peer's timeout,
# heartbeats when idle).
HEARTBEAT_TIMEOUT = 10.0
# What a controller stopped on purpose tells its workers (a Shutdown): they exit quietly.
CONTROLLER_STOPPED = "the controller stopped"
