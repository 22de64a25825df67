"""Counts of kvedit's Triton kernel launches, so that tests and benchmarks can see which kernels
ran (and how often) without a profiler and without a GPU.

Every launch made through :mod:`kvedit.triton` bumps :data:`LAUNCHES` under the kernel's name
(``"attention"``, ``"attention_combine"``, ``"rerotate"``): one dict increment on the host,
nothing on the device. Launches replayed from a captured CUDA graph are not counted (the host
does not launch them). Kept free of any ``triton`` import.

    with count_launches() as launched:
        model.generate(...)
    launched["attention"]  # attention kernels launched inside the block
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

__all__ = ["LAUNCHES", "count_launches", "record"]

LAUNCHES: Counter[str] = Counter()
"""Launches since the process started, per kernel name."""


def record(name: str) -> None:
    """Count one launch of kernel ``name``."""
    LAUNCHES[name] += 1


@contextlib.contextmanager
def count_launches() -> Iterator[Counter[str]]:
    """A ``Counter`` of the launches made inside the block (filled in when the block ends)."""
    start = LAUNCHES.copy()
    counted: Counter[str] = Counter()
    try:
        yield counted
    finally:
        counted.update({k: v - start.get(k, 0) for k, v in LAUNCHES.items() if v > start.get(k, 0)})
