"""The wire: msgpack codec, message validation and gRPC plumbing shared by every process."""
