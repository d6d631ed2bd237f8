"""Gradient compressors (fp16, bf16, random-k, top-k, DGC, QSGD, TernGrad, sign family, PowerSGD)
behind one ``Compressor`` interface, with error-feedback memory, and the collectives that sum
compressed gradients over ranks (``zensync.compress.collectives``: ``CompressedSync``).

Importing this package registers every compressor and every compressed collective, so ``build``
and ``build_collective`` know all their names.

Example::

    from zensync import compress

    comp = compress.build("topk:0.01")
    packed = comp.compress(grad, name="fc.weight", step=0)
    approx = comp.decompress(packed)
"""

from __future__ import annotations

from zensync.compress.base import (
    Compressed,
    Compressor,
    all_finite,
    build,
    compressor_names,
    parse_spec,
    register_compressor,
)
from zensync.compress.cast import BF16Compressor, FP16Compressor, IdentityCompressor
from zensync.compress.collectives import (
    COMPRESSED_SCHEMES,
    CompressedCollective,
    CompressedSync,
    Hierarchy,
    Scheme,
    build_collective,
    collective_names,
    hierarchy,
    register_collective,
)
from zensync.compress.dgc import DGCCompressor
from zensync.compress.error_feedback import ErrorFeedback
from zensync.compress.powersgd import PowerSGDCompressor
from zensync.compress.qsgd import QSGDCompressor
from zensync.compress.randomk import RandomKCompressor
from zensync.compress.sign import EFSignSGDCompressor, OneBitCompressor, SignSGDCompressor
from zensync.compress.terngrad import TernGradCompressor
from zensync.compress.topk import TopKCompressor

__all__ = [
    "COMPRESSED_SCHEMES",
    "BF16Compressor",
    "Compressed",
    "CompressedCollective",
    "CompressedSync",
    "Compressor",
    "DGCCompressor",
    "EFSignSGDCompressor",
    "ErrorFeedback",
    "FP16Compressor",
    "Hierarchy",
    "IdentityCompressor",
    "OneBitCompressor",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "RandomKCompressor",
    "Scheme",
    "SignSGDCompressor",
    "TernGradCompressor",
    "TopKCompressor",
    "all_finite",
    "build",
    "build_collective",
    "collective_names",
    "compressor_names",
    "hierarchy",
    "parse_spec",
    "register_collective",
    "register_compressor",
]
