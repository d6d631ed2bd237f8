"""``zensync demo``: train an embedding-heavy LSTM LM with DDP under several sync strategies and compare them.

Each strategy runs as a fresh process group of ``workers`` processes (loopback, or one emulated host per
worker with ``net``); the parent collects per-step step time, communication time and bytes, and the final
parameters, and prints and saves a comparison against plain DDP.

Example::

    from zensync.demo import DemoConfig, run_demo

    result = run_demo(DemoConfig(workers=2, steps=5, strategies=("ddp", "zen")))
"""

from __future__ import annotations

from zensync.demo.config import STRATEGIES, DemoConfig
from zensync.demo.runner import DemoResult, run_demo

__all__ = ["STRATEGIES", "DemoConfig", "DemoResult", "run_demo"]
