"""rdt_jax transports: the shared base class (`_base`, with `_whole_array` for
backends that move whole arrays, and its rooms: `_required`, `_extract`,
`_fetch`, `_aborts`, `_capabilities`), receive plans (`_plan`, `_destinations`),
opt-in in-band delivery (`_inband`), the lifetime check (`_lifetime`), and one
module or package per backend (`nixl/`, `_collective`, `transfer/`)."""
