"""Model families (HF-compatible), their shapes (ModelArgs), presets and the loader.

Importing this package imports no torch (the router reads model shapes through it); the modules
and the loader are in `pdserve.models.loader`."""

from pdserve.models.args import SUPPORTED_ARCHITECTURES, ModelArgs, resolve_model_args
from pdserve.models.presets import PRESETS

__all__ = ["PRESETS", "SUPPORTED_ARCHITECTURES", "ModelArgs", "resolve_model_args"]
