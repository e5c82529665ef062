"""rdt_jax transports: the shared base class and one module per backend."""
