"""Kernels for the LoopKV cache of `hf_loopcache`.

Subpackages:

- `triton_ops.quant`: KIVI-style 2/4-bit key/value codecs. `triton_ops.quant.naive` is the pure-PyTorch reference:
  the bit-exact contract that Triton kernels must match on codes, and the CPU fallback. See
  `triton_ops/quant/README.md` for the storage layout and the byte model.
- `triton_ops.coded_attention`: attention of new tokens over one cache cell's stored view (`CellView`: sink, KIVI
  codes or a borrowed BF16 plane, window), reading codes as codes; `reference.py` is the contract and CPU path.

Importing this package is cheap and never needs Triton: subpackages are imported explicitly
(`from triton_ops.quant import quantize_keys`), and Triton kernels import `triton` lazily.
"""

__all__: list[str] = []
