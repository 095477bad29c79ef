"""KIVI-style 2/4-bit key/value codecs of the LoopKV cache.

`triton_ops.quant.naive` is the pure-PyTorch reference (the bit-exact contract for the Triton kernels and the CPU
fallback); its public functions are re-exported here, except `quantize_keys` / `quantize_values` / `flush_page`,
which come from `triton_ops.quant.ops`: the same contract and bytes, run by a Triton kernel on CUDA tensors and by the
reference elsewhere. See `README.md` in this folder for the math, the storage layout and the byte model.
"""

from triton_ops.quant.naive import (
    SUPPORTED_NBITS,
    QuantizedKeys,
    QuantizedValues,
    cold_value_error_bound,
    dequantize_keys,
    dequantize_values,
    fake_quantize_keys,
    fake_quantize_values,
    kivi_bytes_per_token,
    pack_codes,
    unpack_codes,
)
from triton_ops.quant.ops import FlushTable, flush_page, flush_page_table, quantize_keys, quantize_values

__all__ = [
    "FlushTable",
    "SUPPORTED_NBITS",
    "QuantizedKeys",
    "QuantizedValues",
    "cold_value_error_bound",
    "dequantize_keys",
    "dequantize_values",
    "fake_quantize_keys",
    "fake_quantize_values",
    "flush_page",
    "flush_page_table",
    "kivi_bytes_per_token",
    "pack_codes",
    "quantize_keys",
    "quantize_values",
    "unpack_codes",
]
