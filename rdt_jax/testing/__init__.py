"""The transport contract, as a test suite you run against your own transport.

A custom transport (a `rdt_jax.DlpackTransport` subclass) passes the same
checks as rdt_jax's own: round trips of every dtype in every framework,
mixed pytrees, 0-d and empty arrays, several consumers of one ref, sharded
`jax.Array`s, `receive_as`, targets, driver `ray.get` and `ray.put`, the
errors that name a leaf, the lifetime contract (the backend's `release` runs
once Ray frees an object, a dead producer's objects fail fast) and leaks
(file descriptors, threads and exported objects return to their baseline).

In a test module of yours (needs pytest: `pip install "rdt-jax[testing]"`)::

    from rdt_jax.testing import TransportContract
    class TestMyTransport(TransportContract): transport = MyTransport

and run pytest on it. The suite starts a local Ray for the class (or uses
the one the session already started) and three actors; `MyTransport` must
be importable by its module path on the workers: the suite puts the
directory its top-level module lies in on their `PYTHONPATH`.
"""

from __future__ import annotations

try:
  import pytest as _pytest  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      "rdt_jax.testing runs the transport contract under pytest, which is not "
      'installed here: pip install "rdt-jax[testing]" (or pip install pytest).'
  ) from e

from rdt_jax.testing._contract import TransportContract

__all__ = ["TransportContract"]
