"""Gradient compressors (fp16, bf16, random-k, top-k, DGC, QSGD, TernGrad, sign family, PowerSGD)
behind one ``Compressor`` interface, with error-feedback memory.

Example::

    from zensync import compress

    comp = compress.build("topk:0.01")
    packed = comp.compress(grad, name="fc.weight", step=0)
    approx = comp.decompress(packed)
"""

from __future__ import annotations

from zensync.compress.base import Compressed, Compressor, build, compressor_names, parse_spec, register_compressor
from zensync.compress.error_feedback import ErrorFeedback

__all__ = [
    "Compressed",
    "Compressor",
    "ErrorFeedback",
    "build",
    "compressor_names",
    "parse_spec",
    "register_compressor",
]
