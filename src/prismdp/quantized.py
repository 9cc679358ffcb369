"""The quantized storage kinds' helpers under their old import path: they live in :mod:`prismdp.base.bnb`
(bitsandbytes) and :mod:`prismdp.base.nf4` (torchao's NF4), behind the seam of :mod:`prismdp.base`."""

from .base.bnb import dequantized_weight, keep_canonical_layout
from .base.nf4 import (TORCHAO_INSTALL, is_nf4, nf4_available, nf4_scaler_block_size, quantize_nf4_layers,
                       to_nf4_weight)

__all__ = ["dequantized_weight", "keep_canonical_layout", "is_nf4", "nf4_scaler_block_size", "to_nf4_weight",
           "quantize_nf4_layers", "nf4_available", "TORCHAO_INSTALL"]
