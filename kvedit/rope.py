"""Rotary position embeddings of a model, per decoder layer, and moving cached keys in position.

Cached keys are post-RoPE: a key cached at position ``p`` is ``rope(k, p)``. Since RoPE is a
rotation, ``rope(k, p + d) == rotate(rope(k, p), d)``, so a cached passage can be moved to other
positions without recomputing it (:func:`rerotate`).

What each layer does is decided by probing, once per model (:func:`movers`): the model runs a
few tokens at positions ``0..n-1`` and again at ``d..d+n-1``, and for every layer kvedit finds
which rotation of the rotary module's own frequencies turns the first keys into the second:
half-split pairs (Llama), interleaved pairs (GPT-J, GLM, Cohere), either on the first ``r`` of
the head dimensions only (partial rotary), or no rotation at all (no-RoPE layers, SmolLM3).
A layer whose keys no rotation explains (learned absolute positions: GPT-2) or whose cached
*values* move with the position (MLA caches such as DeepSeek-V3's) cannot have its keys moved,
and asking for it raises :class:`~kvedit.errors.UnsupportedModelError` naming the layer. RoPE
variants whose frequencies depend on the sequence length (``dynamic``, ``longrope``) are refused
too: a short probe cannot see them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from . import runtime
from .compat import text_config
from .errors import UnsupportedModelError

# RoPE types whose inverse frequencies change with the sequence length: a cached key's rotation
# then depends on how long the sequence was when it was cached, which a fixed delta cannot undo.
_LENGTH_DEPENDENT = ("dynamic", "longrope")
_PROBE_TOKENS, _PROBE_SHIFT = 12, 5
_MOVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

KINDS = ("half", "interleaved", "none")


@dataclass(frozen=True)
class KeyMover:
    """How to move one layer's cached keys in position.

    Attributes:
        layer: the layer index.
        kind: ``"half"`` (pairs ``(i, i + r/2)``), ``"interleaved"`` (pairs ``(2i, 2i+1)``),
            ``"none"`` (keys carry no position), or ``"refused"``.
        inv_freq: ``[r // 2]`` rotary inverse frequencies (None unless rotated); the first
            ``r`` head dimensions rotate, the rest pass through.
        reason: why the layer is refused (``kind == "refused"``), naming model and layer.
    """

    layer: int
    kind: str
    inv_freq: torch.Tensor | None = None
    reason: str = ""

    def move(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Keys ``[batch, kv_heads, n, head_dim]`` at positions ``p`` -> at ``p + delta``."""
        if self.kind == "refused":
            raise UnsupportedModelError(self.reason)
        if self.kind == "none":
            return keys
        return _rotate(keys, delta, self.inv_freq, self.kind == "interleaved")


def _rotate(
    keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate the first ``2 * len(inv_freq)`` head dimensions of ``keys`` by ``delta``
    positions (half-split pairs through :func:`move_keys`, or interleaved pairs)."""
    delta = delta.to(device=keys.device, dtype=torch.long)
    inv_freq = inv_freq.to(device=keys.device, dtype=torch.float32)
    rot = 2 * inv_freq.numel()
    if not interleaved:
        if rot == keys.shape[-1]:
            return move_keys(keys, delta, inv_freq)
        moved = move_keys(keys[..., :rot].contiguous(), delta, inv_freq)
        return torch.cat([moved, keys[..., rot:]], dim=-1)
    angle = delta.to(torch.float32)[:, None] * inv_freq[None, :]  # [n, r/2]
    cos, sin = angle.cos(), angle.sin()
    x = keys[..., :rot].float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat([out.to(keys.dtype), keys[..., rot:]], dim=-1)


def _frequencies(model: PreTrainedModel) -> tuple[list[torch.Tensor], str | None]:
    """Every distinct ``*inv_freq`` buffer of the model's rotary modules, and a refusal."""
    found: list[torch.Tensor] = []
    refusal = None
    for name, module in model.named_modules():
        if not name.endswith("rotary_emb"):
            continue
        rope_type = getattr(module, "rope_type", "default")
        kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        for kind in kinds:
            if kind in _LENGTH_DEPENDENT:
                refusal = (
                    f"RoPE type {kind!r} changes its frequencies with the sequence length, so "
                    "cached keys cannot be moved by a fixed rotation"
                )
        for attr, value in vars(module).get("_buffers", {}).items():
            if attr.endswith("inv_freq") and isinstance(value, torch.Tensor):
                f = value.detach().to("cpu", torch.float32).flatten()
                if not any(f.shape == g.shape and torch.equal(f, g) for g in found):
                    found.append(f)
    return found, refusal


@torch.no_grad()
def _probe_kv(model: PreTrainedModel, shift: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = text_config(model)
    device = next(model.parameters()).device
    n, vocab = _PROBE_TOKENS, int(cfg.vocab_size)
    ids = torch.tensor([[(5 * i + 11) % vocab for i in range(n)]], device=device)
    cache = DynamicCache()
    runtime.forward(model, ids, torch.arange(shift, shift + n, device=device)[None], cache)
    return [(layer.keys.float().cpu(), layer.values.float().cpu()) for layer in cache.layers]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def movers(model: PreTrainedModel) -> tuple[KeyMover, ...]:
    """Per decoder layer, how its cached keys move in position (probed once per model)."""
    cached = _MOVERS.get(model)
    if cached is not None:
        return cached
    runtime.prepare(model)
    name = text_config(model).model_type
    freqs, refusal = _frequencies(model)
    before, after = _probe_kv(model, 0), _probe_kv(model, _PROBE_SHIFT)
    tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 3e-2
    out = []
    for i, ((k0, v0), (k1, v1)) in enumerate(zip(before, after, strict=True)):
        out.append(_decide(name, i, k0, v0, k1, v1, freqs, refusal, tol))
    result = tuple(out)
    _MOVERS[model] = result
    return result


def _decide(name, i, k0, v0, k1, v1, freqs, refusal, tol) -> KeyMover:
    def refused(reason: str) -> KeyMover:
        return KeyMover(i, "refused", reason=f"{name} layer {i}: {reason}")

    if k0.shape != k1.shape or v0.shape != v1.shape:
        return refused("the cache layout changes with the position")
    if _rel(v0, v1) > tol:
        return refused(
            "cached values change with the position (an MLA latent cache or learned absolute "
            "positions), so entries cannot be moved by rotating keys"
        )
    if _rel(k0, k1) <= tol:
        return KeyMover(i, "none")
    if refusal is not None:
        return refused(refusal)
    delta = torch.full((k0.shape[-2],), _PROBE_SHIFT)
    for f in freqs:
        if 2 * f.numel() > k0.shape[-1]:
            continue
        for kind in ("half", "interleaved"):
            moved = _rotate(k0, delta, f, kind == "interleaved")
            if _rel(moved, k1) <= tol:
                return KeyMover(i, kind, f)
    return refused(
        "no rotation of the rotary module's frequencies reproduces this layer's keys at "
        "another position (absolute position embeddings, ALiBi, or an unknown RoPE layout)"
    )


def rerotate(
    model: PreTrainedModel, layer_idx: int, keys: torch.Tensor, delta: torch.Tensor
) -> torch.Tensor:
    """Keys ``[batch, kv_heads, n, head_dim]`` of layer ``layer_idx`` cached at positions ``p``
    -> the same keys at ``p + delta`` (``delta``: ``LongTensor[n]``, may be negative).

    No-RoPE layers return ``keys`` unchanged. Raises
    :class:`~kvedit.errors.UnsupportedModelError` for a layer whose keys cannot be moved.
    """
    return movers(model)[layer_idx].move(keys, delta)


def layer_inv_freq(model: PreTrainedModel) -> list[torch.Tensor]:
    """Per decoder layer, the rotary inverse frequencies ``[head_dim // 2]`` (float32), for
    code that needs full half-split RoPE on every layer (the cross-model projector).

    Raises:
        UnsupportedModelError: a layer is not rotated by half-split RoPE over its whole head.
    """
    cfg = text_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = []
    for mover in movers(model):
        full = mover.kind == "half" and 2 * mover.inv_freq.numel() == head_dim
        if not full:
            why = mover.reason or f"layer {mover.layer}: keys {mover.kind!r}-rotated or partly"
            raise UnsupportedModelError(f"needs half-split RoPE over the whole head; {why}")
        out.append(mover.inv_freq)
    return out


def move_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys ``[batch, kv_heads, n, head_dim]`` cached at positions ``p`` -> the same keys at
    ``p + delta`` (``delta``: ``LongTensor[n]``, may be negative).

    Uses the Triton kernel on CUDA when Triton is available, else the torch reference (float32
    angles either way). Returns a new tensor in ``keys.dtype``.
    """
    from . import triton as kt

    delta = delta.to(device=keys.device, dtype=torch.long)
    inv_freq = inv_freq.to(device=keys.device, dtype=torch.float32)
    if keys.is_cuda and kt.is_available():
        return kt.rerotate(keys.contiguous(), delta, inv_freq)
    return kt.rerotate_reference(keys, delta, inv_freq)
