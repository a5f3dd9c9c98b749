"""pdserve: disaggregated prefill/decode serving for Mixture-of-Experts models."""

from pathlib import Path

__version__ = "0.1.0"

# The repository's top-level folders router/, prefill/, decode/ and kvtransfer/ are this package's
# subpackages (pyproject's package-dir installs them so). A source checkout that is run without
# being installed — the GPU machines run the working tree as it is — finds them beside this folder.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "kvtransfer" / "__init__.py").is_file():
    __path__.append(str(_checkout))
