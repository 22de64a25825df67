"""The gate: :func:`prepare` installs the seam on a model once, after a probe that checks kvedit
can run it exactly, and caches its :class:`ModelSpec`; anything kvedit cannot do exactly raises
:class:`~kvedit.errors.UnsupportedModelError` naming the model, the layer and the reason.

The probe: the seam really is called by every layer; kvedit's attention reproduces the model's
own (logits of a tiny prefill and decode, with a zero bias, against the original functions);
each layer's sliding window comes from the cache layer transformers builds for it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from .. import errors
from ..compat import cache_kwarg, text_config
from .plans import BiasPlan, active_plan, config_key, scoped
from .seam import ATTENTION_NAME, PREPARED, Prepared, register

__all__ = ["LayerSpec", "ModelSpec", "is_prepared", "layer_windows", "prepare", "spec", "unprepare"]

_PREPARE_LOCK = threading.RLock()
_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ModelSpec
_REFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the refusal


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as kvedit sees it.

    Attributes:
        index: the layer index.
        window: the sliding window, or None for global attention.
        kv_heads: KV heads of the layer's cache entries.
        key_dim, value_dim: head dimensions of the cached keys and values (they differ on MLA
            models, which cache a latent and its rotary part).
    """

    index: int
    window: int | None
    kv_heads: int
    key_dim: int
    value_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """What the gate found about a model (see the module docstring).

    Attributes:
        model_type: ``config.model_type`` of the decoder.
        original_attention: the attention implementation the model had before kvedit.
        layers: one :class:`LayerSpec` per decoder layer.
        sinks: whether the attention has per-head sink logits (gpt-oss), implemented by kvedit.
    """

    model_type: str
    original_attention: str
    layers: tuple[LayerSpec, ...]
    sinks: bool

    @property
    def windows(self) -> list[int | None]:
        return [layer.window for layer in self.layers]


def is_prepared(model: PreTrainedModel) -> bool:
    entry = PREPARED.get(config_key(model))
    return entry is not None and entry.model() is model


def prepare(model: PreTrainedModel) -> ModelSpec:
    """Install kvedit's attention seam on ``model`` (once) and return its :class:`ModelSpec`.

    Idempotent and cheap after the first call. The first call probes the model (a few tiny
    forwards) and raises :class:`~kvedit.errors.UnsupportedModelError`, leaving the model as it
    was, when kvedit cannot run it exactly; the refusal is remembered.
    """
    refused = _REFUSED.get(model)
    if refused is not None:
        raise errors.UnsupportedModelError(str(refused))
    cached = _SPECS.get(model)
    if cached is not None and is_prepared(model):
        return cached
    with _PREPARE_LOCK:
        cached = _SPECS.get(model)
        if cached is not None and is_prepared(model):
            return cached
        register()
        cfg = text_config(model)
        original = cfg._attn_implementation or "eager"
        if original == ATTENTION_NAME:
            raise errors.UnsupportedModelError(
                f"{type(model).__name__}: attn_implementation is already 'kvedit' but the model "
                "was not prepared by this process; load it with another implementation"
            )
        model.set_attn_implementation(ATTENTION_NAME)
        key = config_key(model)
        hook = model.register_forward_pre_hook(_before_forward, with_kwargs=True)
        PREPARED[key] = Prepared(original, weakref.ref(model), hook)
        weakref.finalize(model, PREPARED.pop, key, None)
        try:
            if cfg._attn_implementation != ATTENTION_NAME:
                raise errors.UnsupportedModelError(
                    f"{cfg.model_type}: set_attn_implementation('kvedit') was ignored (the model "
                    f"stays on {cfg._attn_implementation!r}); kvedit cannot reach its attention"
                )
            found = _probe(model, original)
        except errors.UnsupportedModelError as e:
            unprepare(model)
            _REFUSED[model] = e
            raise
        except Exception:
            unprepare(model)
            raise
        _SPECS[model] = found
        return found


def unprepare(model: PreTrainedModel) -> None:
    """Undo :func:`prepare`: the original attention implementation, no hook. Idempotent."""
    with _PREPARE_LOCK:
        key = config_key(model)
        entry = PREPARED.get(key)
        if entry is None or entry.model() is not model:
            return
        del PREPARED[key]
        entry.hook.remove()
        model.set_attn_implementation(entry.original)
        _SPECS.pop(model, None)


def spec(model: PreTrainedModel) -> ModelSpec:
    """The model's :class:`ModelSpec` (prepares the model on first use)."""
    return prepare(model)


def layer_windows(model: PreTrainedModel) -> list[int | None]:
    """Per decoder layer: its sliding window, or None for global attention (from the gate)."""
    return spec(model).windows


def _before_forward(model, args, kwargs):
    """The model's forward pre-hook: lets the active plan see each call's inputs."""
    plan = active_plan(model)
    hook = getattr(plan, "before_forward", None)
    if hook is not None:
        hook(model, args, kwargs)
    return None


class _ProbePlan:
    """A zero bias on every layer (forces kvedit's own attention path); records the layers."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.layers: set[int] = set()

    def key_bias(self, layer_idx: int, k_len: int, total_len: int) -> torch.Tensor:
        self.layers.add(layer_idx)
        return torch.zeros(1, 1, k_len, device=self.device)

    def unbiased_queries(self, q_len: int, total_len: int) -> int:
        return 0


_PROBE_TOKENS = 12


def _probe_run(model: PreTrainedModel, plan: BiasPlan | None):
    """A prefill of the probe tokens, then one decode step: ``(logits, cache)``."""
    cfg = text_config(model)
    device = next(model.parameters()).device
    vocab = int(cfg.vocab_size)
    ids = torch.tensor([[(7 * i + 3) % vocab for i in range(_PROBE_TOKENS)]], device=device)
    n = _PROBE_TOKENS - 1
    cache = DynamicCache(config=model.config)
    kw = cache_kwarg(model)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if plan is not None:
            stack.enter_context(scoped(model, plan))
        first = model(
            input_ids=ids[:, :n],
            position_ids=torch.arange(n, device=device)[None],
            use_cache=True,
            **{kw: cache},
        ).logits
        second = model(
            input_ids=ids[:, n:],
            position_ids=torch.tensor([[n]], device=device),
            use_cache=True,
            **{kw: cache},
        ).logits
    return torch.cat([first, second], dim=1).float(), cache


_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")


def _probe(model: PreTrainedModel, original: str) -> ModelSpec:
    cfg = text_config(model)
    name = cfg.model_type
    n_layers = int(cfg.num_hidden_layers)
    for i, kind in enumerate(getattr(cfg, "layer_types", None) or []):
        if kind not in _LAYER_TYPES:
            raise errors.UnsupportedModelError(
                f"{name} layer {i}: layer type {kind!r} has no KV cache kvedit can edit "
                f"(supported: {', '.join(_LAYER_TYPES)})"
            )
    try:
        reference, cache = _probe_run(model, None)
    except Exception as e:
        raise errors.UnsupportedModelError(f"{name}: a plain probe forward failed: {e}") from e
    windows = _cache_windows(name, cache, n_layers)
    plan = _ProbePlan(next(model.parameters()).device)
    ours, _ = _probe_run(model, plan)
    missing = sorted(set(range(n_layers)) - plan.layers)
    if missing:
        raise errors.UnsupportedModelError(
            f"{name}: layers {missing} do not call the attention through transformers' "
            "AttentionInterface, so kvedit cannot bias them"
        )
    scale = reference.abs().max().clamp_min(1e-6)
    err = float((ours - reference).abs().max() / scale)
    dtype = next(model.parameters()).dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not err <= tol:
        raise errors.UnsupportedModelError(
            f"{name}: kvedit's attention does not reproduce the model's own (relative logit "
            f"error {err:.2e} on a probe); an attention feature kvedit does not implement"
        )
    sinks = any(getattr(m, "sinks", None) is not None for m in model.modules())
    layers = tuple(
        LayerSpec(i, w, int(cl.keys.shape[1]), int(cl.keys.shape[-1]), int(cl.values.shape[-1]))
        for i, (w, cl) in enumerate(zip(windows, cache.layers, strict=True))
    )
    return ModelSpec(name, original, layers, sinks)


def _cache_windows(name: str, cache: DynamicCache, n_layers: int) -> list[int | None]:
    """Each layer's window, from the cache layer transformers built for it."""
    if len(cache.layers) != n_layers:
        raise errors.UnsupportedModelError(
            f"{name}: the cache has {len(cache.layers)} layers for {n_layers} decoder layers; "
            "layer-sharing caches are not supported"
        )
    out: list[int | None] = []
    for i, layer in enumerate(cache.layers):
        kind = type(layer).__name__
        keys = getattr(layer, "keys", None)
        if kind not in ("DynamicLayer", "DynamicSlidingWindowLayer") or not isinstance(
            keys, torch.Tensor
        ):
            raise errors.UnsupportedModelError(
                f"{name} layer {i}: cache layer {kind} holds no plain K/V kvedit can edit"
            )
        out.append(int(layer.sliding_window) if kind == "DynamicSlidingWindowLayer" else None)
    return out
