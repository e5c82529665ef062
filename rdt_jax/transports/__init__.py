"""rdt_jax transports: the shared base class (`_base`), receive plans (`_plan`),
opt-in in-band delivery (`_inband`), the lifetime check (`_lifetime`), and one
module or package per backend (`nixl/`, `_collective`, `transfer/`)."""
