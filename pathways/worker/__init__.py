"""A worker host: executes op streams with JAX, keeps results in an object store."""
