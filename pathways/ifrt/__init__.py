"""Unmodified JAX programs on pathways: a server of the IFRT proxy protocol that JAX's
built-in proxy client (``JAX_PLATFORMS=proxy``) speaks, in front of the controller."""
