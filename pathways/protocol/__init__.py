"""The wire protocol between client, controller and workers, as typed messages.

- ``messages``: one frozen dataclass per message kind, the tables of kinds each stream
  accepts, and batch encoding and decoding (the one validation at the trust boundary);
- ``check``: the bounded checkers every field is declared with;
- ``ops``: the op vocabulary of lowered programs, shared by lowering and executor;
- ``errors``: the registry of error kinds and the ``pw.*Error`` each becomes;
- ``handles``: handle arithmetic.

Transports (gRPC, sockets) only move the bytes these produce and consume.
"""
