"""rdt_jax transports: the shared base class (`_base`), receive plans (`_plan`),
in-band delivery (`_inband`), and one module or package per backend (`nixl/`,
`_collective`, `_transfer`)."""
