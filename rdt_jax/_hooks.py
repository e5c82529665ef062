"""The seam's calls into the layers above it, set by the package root.

`_ray` (the seam) sits below `_registry` and `_targets` (both import it), yet two kinds
of Ray call it wraps end there:

* a Ray worker's first RDT lookup registers rdt_jax's transports in that
  worker (`_registry.register`), so consumer-only actors know them;
* Ray's `set_target_for_ref` / `set_target_device_for_ref` on an rdt_jax ref
  hand the target to rdt_jax (`_targets.set_target_for_obj_id`,
  `_targets.set_target_device_for_obj_id`).

The seam calls the slots below instead of importing those modules.
`rdt_jax/__init__.py` fills them when it is imported, which happens before
any rdt_jax module runs in every process; each of its functions imports the
upper module on first call. This module imports nothing of rdt_jax, so
`import rdt_jax` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _not_set(*args: Any) -> Any:
  raise RuntimeError("rdt_jax._hooks is not set: `import rdt_jax` sets it (rdt_jax/__init__.py).")


#: Registers every rdt_jax transport this process can run (`rdt_jax.register`).
register_transports: Callable[[], object] = _not_set
#: Keeps Ray's target buffers of an rdt_jax object for its next fetch:
#: `(obj_id, buffers in leaf order)`.
set_target_buffers: Callable[[str, list[Any]], None] = _not_set
#: Keeps Ray's target device of an rdt_jax object for its next fetch:
#: `(obj_id, device as given to Ray)`.
set_target_device: Callable[[str, Any], None] = _not_set
