"""The few places where transformers 5.x releases differ for what kvedit uses, and the one
reading of a model's config multimodal wrappers need (:func:`text_config`).

transformers 5.24 renamed the ``past_key_values`` argument of ``forward`` to ``cache`` and
announced the removal of the old name for 5.40 (kvedit pins ``<5.40``): :func:`cache_kwarg`.
"""

from __future__ import annotations

import functools
import inspect

from transformers import PreTrainedModel


@functools.cache
def _cache_kwarg_for(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name under which ``model.forward`` takes a KV cache in this transformers version."""
    return _cache_kwarg_for(type(model))


def text_config(model: PreTrainedModel):
    """The decoder config (the text config of multimodal wrappers)."""
    return model.config.get_text_config()
