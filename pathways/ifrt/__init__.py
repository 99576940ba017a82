"""The IFRT proxy front end: unmodified JAX programs (JAX_PLATFORMS=proxy) on a pathways cluster."""
