"""Model families (HF-compatible), their shapes (ModelArgs), presets and the loader."""

from pdserve.models.args import SUPPORTED_ARCHITECTURES, ModelArgs
from pdserve.models.loader import (
    LOAD_FORMATS,
    MODEL_CLASSES,
    init_dummy_weights,
    load_model,
    model_fingerprint,
    resolve_model_args,
)
from pdserve.models.presets import PRESETS

__all__ = [
    "LOAD_FORMATS", "MODEL_CLASSES", "PRESETS", "SUPPORTED_ARCHITECTURES", "ModelArgs",
    "init_dummy_weights", "load_model", "model_fingerprint", "resolve_model_args",
]
