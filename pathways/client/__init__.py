"""The client library: sessions, virtual devices, compiled functions, programs, arrays."""
