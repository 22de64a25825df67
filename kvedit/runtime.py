"""kvedit's runtime: one attention seam, installed once per model, and the gate in front of it.

**The seam.** :func:`prepare` switches a model, once, to the ``"kvedit"`` attention and mask
functions (registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``).
They look up the :class:`BiasPlan` active for the model *in the current context*
(:mod:`contextvars`): with none, they call the model's original attention and mask functions
with the same arguments, so an unsteered forward is bit-for-bit what it was before kvedit
touched the model; with one, they run kvedit's attention (:func:`kvedit.attention.attend`),
which adds the plan's per-key bias and masks causally, aligned bottom-right. The implementation
is never flipped per call, so a forward in another thread, or in this thread outside an
:func:`activate` block, is never steered. :func:`unprepare` restores the original.

What a prepared model looks like to other code: ``model.config._attn_implementation`` is
``"kvedit"`` (``unprepare`` puts the original back; save a model after ``unprepare`` if the
saved config must name the original); a forward pre-hook is registered on the model; outputs
are unchanged while no plan is active. ``torch.compile`` sees Python control flow in the
attention (a context-variable lookup per layer) and breaks the graph there.

**The gate.** :func:`spec` (called by :func:`prepare`) probes the model once and caches a
:class:`ModelSpec`: the seam really is called by every layer; kvedit's attention reproduces
the model's own (logits of a tiny prefill and decode, with a zero bias, against the original
functions); each layer's sliding window comes from the cache layer transformers builds for it.
Anything kvedit cannot do exactly raises :class:`~kvedit.errors.UnsupportedModelError`
naming the model, the layer and the reason, before any work.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import errors
from .attention import attend, attention_probs
from .compat import cache_kwarg, text_config

ATTENTION_NAME = "kvedit"

# Attention keyword arguments kvedit's attention may ignore: they say nothing it does not
# already know (positions are in the keys, causality is bottom-right by construction).
_IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "output_attentions",
        "use_cache",
        "past_key_values",
        "cache",
        "layer_idx",
        "position_embeddings",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
    }
)


class BiasPlan(Protocol):
    """Where the additive key bias of one model comes from, for one context."""

    def key_bias(self, layer_idx: int, k_len: int, total_len: int) -> torch.Tensor | None:
        """Bias for the ``k_len`` keys of layer ``layer_idx``: ``[batch, kv_heads|heads, k_len]``.

        ``total_len`` is the absolute length of the sequence including the current queries, so
        key entry ``j`` holds absolute token ``total_len - k_len + j`` (sliding-window caches hold
        only the most recent tokens). Returns None for no bias on this layer.
        """

    def unbiased_queries(self, q_len: int, total_len: int) -> int:
        """How many leading queries of this call attend without the bias (0: all are biased)."""


# --------------------------------------------------------------------------------------------
# Plans: per model, per context
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Active:
    plan: BiasPlan
    owner: object | None
    model: weakref.ref


# Never mutated in place: activate() sets a new dict, so the shared default stays empty.
_NO_PLANS: dict[int, _Active] = {}
_PLANS: contextvars.ContextVar[dict[int, _Active]] = contextvars.ContextVar("kvedit_plans")


def _config_key(model_or_module) -> int:
    cfg = model_or_module.config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return id(cfg)


def _active(key: int) -> _Active | None:
    return _PLANS.get(_NO_PLANS).get(key)


def active_plan(model: PreTrainedModel) -> BiasPlan | None:
    """The plan active for ``model`` in the current context, if any."""
    entry = _active(_config_key(model))
    return None if entry is None or entry.model() is not model else entry.plan


@contextlib.contextmanager
def activate(
    model: PreTrainedModel, plan: BiasPlan, owner: object | None = None
) -> Iterator[BiasPlan]:
    """Make ``plan`` the active plan of ``model`` in the current context, inside the block.

    The model is prepared first (:func:`prepare`). Activating a plan while another one is
    active for the same model raises :class:`~kvedit.errors.NestedSteeringError`, unless both
    name the same ``owner`` (a steering handle re-entering itself): then the inner plan
    replaces the outer one until the inner block ends.
    """
    prepare(model)
    key = _config_key(model)
    plans = _PLANS.get(_NO_PLANS)
    current = plans.get(key)
    mine = current is not None and current.model() is model
    if mine and (owner is None or current.owner is not owner):
        raise errors.NestedSteeringError(
            f"nested steering: {type(model).__name__} already has an active kvedit plan in this "
            "context (a steer block or a state's own run); leave it first, or combine the "
            "spans in one call"
        )
    token = _PLANS.set({**plans, key: _Active(plan, owner, weakref.ref(model))})
    try:
        yield plan
    finally:
        _PLANS.reset(token)


@contextlib.contextmanager
def detached(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block, ``model`` has no active plan in the current context: kvedit's own
    runs of it (a capture, a readout) may activate theirs. For work a plan does before the
    forward it steers (``steer(focus=True)`` reads the prompt's cache first); the outer plan
    is active again when the block ends."""
    key = _config_key(model)
    plans = _PLANS.get(_NO_PLANS)
    token = _PLANS.set({k: v for k, v in plans.items() if k != key})
    try:
        yield
    finally:
        _PLANS.reset(token)


def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache,
    *,
    plan: BiasPlan | None = None,
    logits_to_keep: int = 0,
    attention_mask=None,
) -> torch.Tensor:
    """The one way kvedit runs a model: ``input_ids [batch, n]`` at explicit
    ``position_ids [batch, n]`` on top of ``cache`` (a transformers cache, updated in place),
    with ``plan`` active when given (else whatever plan the context has). Returns the logits
    ``[batch, n | logits_to_keep, vocab]``. The model is prepared first.
    """
    prepare(model)
    kwargs = {cache_kwarg(model): cache}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if plan is not None:
            stack.enter_context(activate(model, plan))
        return model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kwargs,
        ).logits


# --------------------------------------------------------------------------------------------
# Preparing a model: the seam, installed once
# --------------------------------------------------------------------------------------------


@dataclass
class _Prepared:
    original: str
    model: weakref.ref
    hook: object


_PREPARE_LOCK = threading.RLock()
_PREPARED: dict[int, _Prepared] = {}  # config key -> what prepare() changed
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


def register() -> None:
    """Register the ``"kvedit"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvedit_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, kvedit_mask)


def is_prepared(model: PreTrainedModel) -> bool:
    entry = _PREPARED.get(_config_key(model))
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
        key = _config_key(model)
        hook = model.register_forward_pre_hook(_before_forward, with_kwargs=True)
        _PREPARED[key] = _Prepared(original, weakref.ref(model), hook)
        weakref.finalize(model, _PREPARED.pop, key, None)
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
        key = _config_key(model)
        entry = _PREPARED.get(key)
        if entry is None or entry.model() is not model:
            return
        del _PREPARED[key]
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


# --------------------------------------------------------------------------------------------
# The mask function and the attention function transformers calls
# --------------------------------------------------------------------------------------------


def _original(config) -> str | None:
    if config is None:
        return None
    entry = _PREPARED.get(id(config))
    return None if entry is None else entry.original


def kvedit_mask(*args, attention_mask: torch.Tensor | None = None, config=None, **kwargs):
    """Mask function for ``AttentionMaskInterface``.

    With a plan active: the 2D padding mask (``[batch, total_len]`` bool, True = attend) or
    None when nothing is padded; causal and window masking happen in the attention. Without
    one: the original implementation's mask function, called with the same arguments.
    """
    key = None if config is None else id(config)
    if key is not None and _active(key) is None:
        original = _original(config)
        if original is not None:
            fn = ALL_MASK_ATTENTION_FUNCTIONS[original]
            return fn(*args, attention_mask=attention_mask, config=config, **kwargs)
    if attention_mask is None or (attention_mask.ndim == 2 and bool(attention_mask.all())):
        return None
    return attention_mask


def _original_attention(module: torch.nn.Module, name: str):
    if name == "eager":  # modeling files keep eager attention as a module-level function
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise errors.UnsupportedModelError(
                f"{type(module).__module__}: no eager_attention_forward to delegate to"
            )
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


def kvedit_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers' ``AttentionInterface``; returns ``[batch, q_len, heads, dim]``.

    ``query [batch, heads, q_len, dim]``, ``key``/``value [batch, kv_heads, k_len, dim]``.
    Without an active plan for ``module``'s model in this context: the original function.
    """
    config_key = id(module.config)
    active = _active(config_key)
    if active is None:
        entry = _PREPARED.get(config_key)
        if entry is None:
            raise errors.UnsupportedModelError(
                "the 'kvedit' attention was called for a model kvedit did not prepare; use "
                "kvedit.prepare(model) instead of set_attn_implementation('kvedit')"
            )
        fn = _original_attention(module, entry.original)
        extra = {} if s_aux is None else {"s_aux": s_aux}
        return fn(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            **extra,
            **kwargs,
        )
    unknown = sorted(
        k
        for k, v in kwargs.items()
        if k not in _IGNORED_KWARGS
        and not k.startswith(("output_", "return_"))
        and v is not None
        and not (k == "is_causal" and v is True)
    )
    if unknown:
        raise errors.UnsupportedModelError(
            f"{getattr(module.config, 'model_type', '?')} layer {module.layer_idx}: attention "
            f"arguments {unknown} are not implemented by kvedit's attention"
        )
    plan = active.plan
    q_len, k_len = query.shape[2], key.shape[2]
    padding = None
    custom_mask = None
    total_len = k_len
    if attention_mask is not None:
        if attention_mask.ndim == 2:
            total_len = max(attention_mask.shape[-1], k_len)
            padding = _right_align(attention_mask.bool(), k_len)
        else:  # a 4D mask prepared by the caller already encodes causality
            custom_mask = attention_mask[..., -k_len:]
    bias = plan.key_bias(module.layer_idx, k_len, total_len)
    unbiased = plan.unbiased_queries(q_len, total_len) if bias is not None else q_len
    observe = getattr(plan, "observe", None)
    common = dict(
        scale=scaling,
        bias=bias,
        unbiased_queries=unbiased,
        padding=padding,
        window=sliding_window,
        softcap=softcap,
        sinks=s_aux,
    )
    if observe is not None:
        observe(module.layer_idx, attention_probs(query, key, **common))
    out = attend(query, key, value, custom_mask=custom_mask, **common)
    return out.transpose(1, 2).contiguous(), None


def _right_align(mask_2d: torch.Tensor, k_len: int) -> torch.Tensor:
    """The last ``k_len`` columns of a ``[batch, total]`` mask (left-padded with True if short)."""
    if mask_2d.shape[-1] >= k_len:
        return mask_2d[:, -k_len:]
    pad = mask_2d.new_ones(mask_2d.shape[0], k_len - mask_2d.shape[-1])
    return torch.cat([pad, mask_2d], dim=-1)


# --------------------------------------------------------------------------------------------
# The probe behind the gate
# --------------------------------------------------------------------------------------------


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
            token = _PLANS.set(
                {
                    **_PLANS.get(_NO_PLANS),
                    _config_key(model): _Active(plan, None, weakref.ref(model)),
                }
            )
            stack.callback(_PLANS.reset, token)
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
