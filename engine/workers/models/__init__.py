"""What every model family shares: device and dtype, weights files and downloads, and the
preprocessing contract run in `fast` or `exact` mode. The families (classify.py: timm;
sam2_model.py: SAM 2) say only what differs: how to build the model and what its contract is.
Every error names the config key it is about (`models.classify.weights`, `models.sam2.checkpoint`, ...).
"""

from .device import resolve_device, resolve_dtype
from .preprocess import InputContract, Preprocessor
from .weights import fetch_pretrained, hub_file, load_strict, read_state_dict

__all__ = ["InputContract", "Preprocessor", "fetch_pretrained", "hub_file", "load_strict", "read_state_dict",
           "resolve_device", "resolve_dtype"]
