"""Attention over KIVI-quantized pages (packed 2/4/8-bit codes) plus a full-precision tail."""
