"""The part of a merged (MiniCache) pair both layers share: its K/V unit directions.

A pair of layers ``(l, l + 1)`` merged by :func:`kvedit.compress.minicache` stores, for its
first ``m`` entries, one unit direction per entry and KV head for both layers
(:class:`SharedDirections`, written once per file under its ``uid``); each layer
(:class:`~kvedit.cache.merged.MergedLayerKV`) keeps its own norms, retained entries and tail.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import weakref
from dataclasses import dataclass

import torch

from .packed import PackedKV, load_packed_kv, packed_kv_tensors

__all__ = ["SharedDirections", "new_uid", "pack_directions"]

# (uid, content digest, device, dtype) -> the SharedDirections object built from a file, so the
# two members of a loaded pair hold one copy. The digest keeps two files that carry the same
# pair under different contents (saved at two dtypes, say) from sharing each other's data.
_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def pack_directions(x: torch.Tensor, bits: int, group: int, axis: str) -> PackedKV:
    """Unit directions ``x [batch, kv_heads, m, head_dim]`` as a :class:`PackedKV`:
    quantized KIVI-style at ``bits`` (whole groups of ``group`` entries for ``axis="channel"``,
    the rest exact), or all exact (``bits`` 0: everything in the residual)."""
    b, h, m, d = x.shape
    if bits == 0:
        empty = x.new_zeros((b, h, 0, d), dtype=torch.uint8)
        meta = (b, h, 0, 1, d) if axis == "channel" else (b, h, 0, d // group, 1)
        zeros = x.new_zeros(meta, dtype=torch.float16)
        return PackedKV(empty, zeros, zeros.clone(), x.contiguous(), 8, group, axis)
    n_quant = (m // group) * group if axis == "channel" else m
    return PackedKV.quantize(x, bits, group, n_quant, axis)


@dataclass(eq=False, frozen=True)
class SharedDirections:
    """The part of a merged pair both layers share.

    Attributes:
        uid: names the pair (storage writes its tensors once per uid).
        keys, values: unit directions ``[batch, kv_heads, m, head_dim]``, packed
            (:func:`pack_directions`).
        retained: ``LongTensor [r]``, sorted indices (in ``[0, m)``) of the merged-part entries
            each layer keeps exactly.
        bits: 0 (directions exact) or the bits they are quantized to.

    Frozen (the attributes, not the tensors' data); only the memo of objects derived from it
    (:meth:`map`, :meth:`to`) fills in.
    """

    uid: str
    keys: PackedKV
    values: PackedKV
    retained: torch.Tensor
    bits: int = 0
    _derived: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        """Merged entries ``m``."""
        return self.keys.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.keys.residual.device

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.retained.numel() * 8

    def map(self, fn) -> SharedDirections:
        """``fn`` applied to every tensor; the two members of a pair mapping with the same
        ``fn`` (``torch.clone``, a move) get one result while it is alive."""
        key = fn if not isinstance(fn, str) else ("to", fn)
        cache = self._derived.setdefault("map", weakref.WeakValueDictionary())
        try:
            found = cache.get(key)
        except TypeError:  # an unhashable fn
            found, cache = None, None
        if found is not None:
            return found
        out = SharedDirections(
            self.uid, self.keys.map(fn), self.values.map(fn), fn(self.retained), self.bits
        )
        if cache is not None:
            cache[key] = out
        return out

    def to(self, device: torch.device | str) -> SharedDirections:
        device = torch.device(device)
        if self.device == device:
            return self
        cache = self._derived.setdefault("to", weakref.WeakValueDictionary())
        found = cache.get(str(device))
        if found is None:
            found = SharedDirections(
                self.uid,
                self.keys.map(lambda t: t.to(device)),
                self.values.map(lambda t: t.to(device)),
                self.retained.to(device),
                self.bits,
            )
            cache[str(device)] = found
        return found

    def tensors(self, cast=None) -> dict[str, torch.Tensor]:
        """The tensors to store (on CPU, contiguous); ``cast`` converts the exact directions."""
        out = packed_kv_tensors(self.keys, self.values, cast, " directions")
        out["retained"] = self.retained.to("cpu").contiguous()
        return out

    @classmethod
    def from_tensors(
        cls,
        uid: str,
        tensors: dict[str, torch.Tensor],
        bits: int,
        groups: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> SharedDirections:
        """The pair's shared part from ``tensors`` (names as :meth:`tensors`); one object per
        ``(uid, contents, device, dtype)`` while it is alive."""
        memo = (uid, _digest(tensors), str(device), str(dtype))
        found = _LOADED.get(memo)
        if found is not None:
            return found
        keys, values = load_packed_kv(tensors, bits or 8, groups, device, dtype)
        out = cls(uid, keys, values, tensors["retained"].to(device), bits)
        _LOADED[memo] = out
        return out


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the tensors' names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def new_uid() -> str:
    """A fresh pair name."""
    return secrets.token_hex(8)
