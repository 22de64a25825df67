"""Shared test set-up.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so it must be set before
``kvedit.triton`` is imported: here, before any test module imports kvedit.
"""

from __future__ import annotations

import os

try:  # pragma: no cover - depends on the machine
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
