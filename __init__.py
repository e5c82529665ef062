"""Not a package: the root of an rdt_jax source checkout (the package is `rdt_jax/` inside it).

Python runs this file only when a checkout's folder is itself named `rdt_jax` and
sits in a folder on `sys.path`, most often beside the script being run (Python
puts the script's folder first on `sys.path`, and Ray puts it on every worker's).
`import rdt_jax` would then find the checkout instead of the installed package:
without this file, as a namespace package with none of rdt_jax's names
("module 'rdt_jax' has no attribute 'register'"). This file turns that into an
ImportError that names the folder and the fix. Imported under any other name, it
does nothing.
"""

import os as _os

if __name__ == "rdt_jax":
  _folder = _os.path.dirname(_os.path.abspath(__file__))
  raise ImportError(
      f"'import rdt_jax' found {_folder}, the root of an rdt_jax source checkout, instead of the installed "
      f"package: a folder named rdt_jax in {_os.path.dirname(_folder)}, the folder of the script being run (or "
      "another folder on sys.path), shadows it. Rename the checkout (for example to rdt-jax) and reinstall it "
      "from there (pip install -e .), or keep the script in another folder.",
      name="rdt_jax", path=__file__,
  )
