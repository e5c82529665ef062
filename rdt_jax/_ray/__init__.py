"""The one seam to Ray's internals, one room per Ray feature it touches.

Every place where rdt_jax touches something of Ray that is not public API is
in this package, so a Ray upgrade has one package to check, room by room.
`install()` checks that each internal still has the shape rdt_jax relies on
(`version.check_ray`), then puts the wraps and reducers in place, once per
process.

Rooms, bottom up:

* `wrapping`: how a wrap is marked (so it is installed once and its original
  stays readable), and the install lock.
* `version`: the tested Ray range and the shape checks, run at install.
* `state`: read-only lookups of Ray's state (and three direct calls).
* `serialization`: the reducers that take array leaves out of band, and the
  wrap around Ray's serialization of an RDT value.
* `failures`: Ray's failure monitor, kept alive.
* `fetch`: `ray.get` of an rdt_jax ref: two-sided refusals, Ray's targets,
  unknown objects, the fetches a failed batch leaves.
* `names`: Ray's check of a transport name, explained.
* `aio`: `await ref` refused at once, nested refs.
* `registration`: transports registered on new actors and consumer-only
  workers, and `install()`.

Each function that touches a Ray internal says so in its docstring
(`Touches:`, `Why:`, `Retire when:`); `docs/ray_integration.md` lists them
all in a table generated from those docstrings (`scripts/ray_internals.py`),
tested equal. Imports no Ray until a function runs.
"""

from __future__ import annotations

from rdt_jax._ray import aio, failures, fetch, names, registration, serialization, state, version, wrapping

__all__ = [
    "aio", "failures", "fetch", "install", "names", "registration", "serialization", "state", "version", "wrapping",
]

install = registration.install
