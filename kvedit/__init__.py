"""kvedit: edit a language model's KV cache to change what it pays attention to."""

from __future__ import annotations

__version__ = "0.1.0"
