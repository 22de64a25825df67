"""Fingerprints that tie a stored cache to the model and tokenizer that made it.

**What "the same model" means.** Two models are the same when a cache made by one is valid
for the other: the same architecture-defining config fields (:data:`_CONFIG_KEYS`: layer
count, heads, head size, windows, RoPE...) and the same weights *up to the dtype they are held
in*. A stored cache is cast to the model's dtype when it is loaded, so a float32 model and its
bfloat16 copy share caches. Concretely, every tensor of the model's ``state_dict`` (parameters
and persistent buffers) is hashed whole (SHA-256), each floating-point tensor after rounding it
to bfloat16, the coarsest dtype models are run in: a float32 model and ``model.to(bfloat16)``
give the same fingerprint, while a change of any single weight anywhere in a tensor (by more
than bfloat16's precision, 2^-8 relative) gives another. A float16 copy usually differs (its
narrower exponent range flushes tiny weights, and rounding twice can land elsewhere).
Integer and bool tensors are hashed as they are, with their dtype. Names, dtypes, devices and
kvedit/transformers versions do not count.

**Cost.** Hashing reads every weight once: SmolLM2-135M takes about 0.2 s on 2 CPU cores
(a bfloat16 model skips the rounding). The result is memoised per model object and recomputed
only for tensors that changed: each tensor is remembered with its identity, data pointer,
dtype, shape and autograd version counter, which every in-place write (``p.add_(...)``,
``p[0] = ...``, ``load_state_dict``, ``model.to(...)``) bumps. Writes through ``p.data`` are not
counted by torch and are not seen; call :func:`forget` after such a write.

Tokenizer fingerprints hash the vocabulary and the special tokens, memoised per tokenizer
object until its size or special tokens change.

Format version 1 of kvedit's state files recorded the previous fingerprint (a sample of the
first and last 2,048 values of each tensor, cast to float32), which
:func:`legacy_model_fingerprint` still computes to read those files.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

FINGERPRINT_VERSION = 2
# Values rounded to bfloat16 at a time. At most torch's parallel grain size (32768), so each
# copy runs on one thread: the copy is memory-bound, and on a busy machine torch's thread pool
# made it 10-40x slower than one thread.
_CHUNK = 1 << 15
_LEGACY_SAMPLE = 2048

_LOCK = threading.RLock()
_MODEL_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LEGACY_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZER_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Config fields that change the meaning of a KV cache. Names, dtypes and versions do not.
_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "layer_types",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "rope_local_base_freq",
    "query_pre_attn_scalar",
)

__all__ = [
    "FINGERPRINT_VERSION",
    "forget",
    "legacy_model_fingerprint",
    "model_config_summary",
    "model_fingerprint",
    "tensor_digest",
    "tokenizer_fingerprint",
]


def model_config_summary(model: PreTrainedModel) -> dict:
    """The config fields that define a cache's layout and meaning, as a JSON-able dict."""
    cfg = model.config.get_text_config()
    out = {}
    for key in _CONFIG_KEYS:
        value = getattr(cfg, key, None)
        if value is not None:
            out[key] = value
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def _tensor_stamp(t: torch.Tensor) -> tuple:
    """What identifies a tensor's current contents without reading them."""
    try:
        version = t._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        version = None
    return (
        id(t),
        version,
        t.data_ptr() if not t.is_meta else 0,
        t.dtype,
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        str(t.device),
    )


def _named_tensors(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers by ``state_dict`` name (tied ones under each name)."""
    return list(model.state_dict(keep_vars=True).items())


def _update_raw(h, flat: torch.Tensor) -> None:
    flat = flat.contiguous().cpu()
    try:
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    except (RuntimeError, TypeError):  # a dtype numpy cannot view (quantized, ...)
        h.update(memoryview(flat.float().view(torch.uint8).numpy()))


def tensor_digest(t: torch.Tensor) -> bytes:
    """SHA-256 of a tensor's shape and contents, dtype-independent for floating-point tensors
    (their values rounded to bfloat16); integer and bool tensors hash their dtype and bytes."""
    h = hashlib.sha256()
    h.update(repr(tuple(t.shape)).encode())
    if t.is_meta:
        h.update(b"meta")
        return h.digest()
    flat = t.detach().reshape(-1)
    if not flat.is_floating_point():
        h.update(str(t.dtype).encode())
        if flat.numel():
            _update_raw(h, flat)
        return h.digest()
    h.update(b"bfloat16")
    n = flat.numel()
    if flat.dtype == torch.bfloat16 and flat.device.type == "cpu":
        if n:
            h.update(memoryview(flat.contiguous().view(torch.int16).numpy()))
        return h.digest()
    if flat.device.type != "cpu":
        flat = flat.to(torch.bfloat16)  # round on the device, copy half the bytes
    buffer = torch.empty(min(n, _CHUNK), dtype=torch.bfloat16)
    as_bytes = buffer.view(torch.int16).numpy()
    for start in range(0, n, _CHUNK):
        part = flat[start : start + _CHUNK]
        k = part.numel()
        buffer[:k].copy_(part)  # round to nearest even, exactly as .to(torch.bfloat16)
        h.update(memoryview(as_bytes[:k]))
    return h.digest()


def _memoised(cache: weakref.WeakKeyDictionary, model, compute) -> str:
    """``compute(tensors, old_digests)`` memoised on the model's tensors' stamps and config."""
    with _LOCK:
        tensors = _named_tensors(model)
        summary = json.dumps(model_config_summary(model), sort_keys=True)
        stamps = tuple((name, _tensor_stamp(t)) for name, t in tensors)
        try:
            cached = cache.get(model)
        except TypeError:  # not weak-referenceable: no memo
            return compute(summary, tensors, stamps, {})[0]
        if cached is not None and cached[0] == (summary, stamps):
            return cached[1]
        old = cached[2] if cached is not None else {}
        digest, per_tensor = compute(summary, tensors, stamps, old)
        cache[model] = ((summary, stamps), digest, per_tensor)
        return digest


def _compute(summary, tensors, stamps, old) -> tuple[str, dict]:
    h = hashlib.sha256()
    h.update(f"kvedit.fingerprint/{FINGERPRINT_VERSION}".encode())
    h.update(summary.encode())
    per_tensor: dict[tuple, bytes] = {}
    with torch.no_grad():
        for (name, t), (_, stamp) in zip(tensors, stamps, strict=True):
            digest = per_tensor.get(stamp) or old.get(stamp)
            if digest is None:
                digest = tensor_digest(t)
            per_tensor[stamp] = digest
            h.update(len(name).to_bytes(8, "little"))
            h.update(name.encode())
            h.update(digest)
    return h.hexdigest()[:32], per_tensor


def model_fingerprint(model: PreTrainedModel) -> str:
    """A short hex digest of ``model``'s cache-defining config and weights (module docstring).

    Memoised per model object; recomputed for the tensors that changed since the last call.
    """
    return _memoised(_MODEL_CACHE, model, _compute)


def _compute_legacy(summary, tensors, stamps, old) -> tuple[str, dict]:
    h = hashlib.sha256()
    h.update(summary.encode())
    with torch.no_grad():
        for name, param in tensors:
            flat = param.detach().reshape(-1)
            sample = torch.cat([flat[:_LEGACY_SAMPLE], flat[-_LEGACY_SAMPLE:]])
            h.update(name.encode())
            h.update(str(tuple(param.shape)).encode())
            h.update(sample.to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()[:32], {}


def legacy_model_fingerprint(model: PreTrainedModel) -> str:
    """The fingerprint kvedit 0.1 recorded (state file format version 1): the config and the
    first and last 2,048 values of every tensor, as float32. Only for reading old files."""
    return _memoised(_LEGACY_CACHE, model, _compute_legacy)


def forget(model: PreTrainedModel | None = None) -> None:
    """Drop the memoised fingerprints of ``model`` (of every model when None), e.g. after
    writing its weights through ``.data``, which torch does not count as a change."""
    with _LOCK:
        for cache in (_MODEL_CACHE, _LEGACY_CACHE):
            if model is None:
                cache.clear()
            else:
                cache.pop(model, None)


def _tokenizer_stamp(tokenizer) -> tuple:
    return (
        len(tokenizer),
        tuple(tokenizer.all_special_tokens),
        str(getattr(tokenizer, "bos_token", None)),
    )


def _compute_tokenizer(tokenizer) -> str:
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    h.update(str(getattr(tokenizer, "bos_token", None)).encode())
    return h.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hex digest of the tokenizer's vocabulary and special tokens.

    Memoised per tokenizer object, recomputed when its size (added tokens) or special tokens
    change.
    """
    stamp = _tokenizer_stamp(tokenizer)
    with _LOCK:
        try:
            cached = _TOKENIZER_CACHE.get(tokenizer)
        except TypeError:  # not weak-referenceable
            return _compute_tokenizer(tokenizer)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        digest = _compute_tokenizer(tokenizer)
        _TOKENIZER_CACHE[tokenizer] = (stamp, digest)
        return digest
