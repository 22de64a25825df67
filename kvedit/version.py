"""kvedit's version, and a digest of the source that is running, in a module of its own so any
module can read them without importing the package root."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__version__ = "0.3.0"

__all__ = ["__version__", "source_digest"]


@functools.cache
def source_digest() -> str:
    """SHA-256 (hex) of kvedit's own Python source: every ``.py`` file of the package, by its
    path inside the package and its bytes, in path order.

    Two runs with the same digest ran the same kvedit code, so an eval may take one run's
    answers for the other's (``kvedit eval litm --reuse``/``--resume``); a version number alone
    does not say that during development. Computed once per process (about 250 small files)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        data = path.read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()
