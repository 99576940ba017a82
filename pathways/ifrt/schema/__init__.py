"""The IFRT proxy protocol's schema: the .proto subset under this directory (mirroring XLA's paths)
from which ``pathways.proto`` is generated (``python -m pathways.ifrt.schema``)."""
