"""A model's configuration read before its weights (:func:`peek_config`), so that what the
configuration alone rules out (a forgetting policy a model's layers cannot serve,
:meth:`kvedit.compress.Scorer.refuses_config`) is refused before the model loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvedit.errors import KVEditError

__all__ = ["peek_config"]


def peek_config(name_or_path: str) -> Any | None:
    """The transformers configuration of the model :func:`kvedit.models.load_model` would
    load for ``name_or_path`` (a tiny test model's, a registered model's, a Hugging Face
    folder's or a GGUF file's), without its weights; None when it cannot be read so (the
    model's own load then says why, and the checks after it decide)."""
    name = str(name_or_path)
    try:
        if name.startswith("tiny-"):
            return _tiny_config(name.removeprefix("tiny-"))
        return _file_config(name)
    except (KVEditError, OSError, ValueError, ImportError, KeyError):
        return None


def _tiny_config(arch: str) -> Any | None:
    from kvedit.testing import tiny_config

    return tiny_config(arch)


def _file_config(name: str) -> Any | None:
    from transformers import AutoConfig

    from kvedit.models import MODELS

    if name in MODELS:
        folder, gguf = MODELS[name].locate()
    else:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            folder, gguf = path.parent, path.name
        elif (path / "config.json").is_file():
            folder, gguf = path, None
        else:
            return None
    kwargs = {"gguf_file": gguf} if gguf else {}
    return AutoConfig.from_pretrained(folder, **kwargs)
