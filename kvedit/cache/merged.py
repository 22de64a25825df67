"""The merged cache layer: two adjacent layers that share their K/V directions (MiniCache).

See :func:`kvedit.ops.minicache.minicache` for how a state gets these layers. A *pair* of
layers ``(l, l + 1)`` holding the same entries stores, for its first ``m`` entries, one unit
direction per entry and KV head for both layers (:class:`SharedDirections`, written once), and
per layer (:class:`MergedLayerKV`, one per decoder layer, ``member`` 0 or 1):

* ``key_norms`` / ``value_norms`` ``[batch, kv_heads, m]``: the layer's own magnitudes;
* ``retained_keys`` / ``retained_values`` ``[batch, kv_heads, r, head_dim]``: the layer's exact
  K/V of the ``r`` retained entries (``shared.retained``, where the two layers disagree most);
* ``tail_keys`` / ``tail_values`` ``[batch, kv_heads, n - m, head_dim]``: the entries after the
  merged part (the most recent ones and every appended one), exact.

A member's keys are ``key_norms[..., None] * shared keys`` on the merged part, the retained
entries replaced by ``retained_keys``, then ``tail_keys`` (values alike). Shapes as
:class:`~kvedit.cache.LayerKV`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CorruptCacheError, InvalidInputError
from .dense import LayerKV
from .quantized import BITS, PackedKV
from .registry import register_layer

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


@dataclass(eq=False)
class SharedDirections:
    """The part of a merged pair both layers share.

    Attributes:
        uid: names the pair (storage writes its tensors once per uid).
        keys, values: unit directions ``[batch, kv_heads, m, head_dim]``, packed
            (:func:`pack_directions`).
        retained: ``LongTensor [r]``, sorted indices (in ``[0, m)``) of the merged-part entries
            each layer keeps exactly.
        bits: 0 (directions exact) or the bits they are quantized to.
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
        cast = cast or (lambda t, what: t)
        out: dict[str, torch.Tensor] = {}
        for name, p in (("keys", self.keys), ("values", self.values)):
            out[f"{name}.codes"] = p.codes.to("cpu").contiguous()
            out[f"{name}.scale"] = p.scale.to("cpu").contiguous()
            out[f"{name}.zero"] = p.zero.to("cpu").contiguous()
            out[f"{name}.residual"] = cast(p.residual.to("cpu").contiguous(), f"{name} directions")
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
        packed = {
            name: PackedKV(
                codes=tensors[f"{name}.codes"].to(device),
                scale=tensors[f"{name}.scale"].to(device),
                zero=tensors[f"{name}.zero"].to(device),
                residual=tensors[f"{name}.residual"].to(device, dtype),
                bits=bits or 8,
                group=group,
                axis="channel" if name == "keys" else "token",
            )
            for name, group in zip(("keys", "values"), groups, strict=True)
        }
        out = cls(uid, packed["keys"], packed["values"], tensors["retained"].to(device), bits)
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


@register_layer
@dataclass(init=False, repr=False, eq=False)
class MergedLayerKV(LayerKV):
    """One layer of a merged pair (see the module doc), a global layer.

    ``keys`` and ``values`` are rebuilt on every access (:meth:`dense_kv`). Constructed from
    its parts, or, as other ops do (``dataclasses.replace(layer, keys=k)``), from dense
    ``keys``/``values``: when they equal the layer's merged part, it is kept (a change after
    it goes to the exact tail); when an op changed merged entries (``scale_keys`` on them, a
    move), the layer leaves the pair and holds the op's result exactly, all in its tail
    (``shared`` None).

    ``nbytes`` counts the layer's own tensors and half of the shared part (member 0 the odd
    byte), so a state holding both members counts the pair once.
    """

    kind: ClassVar[str] = "merged"
    lossless: ClassVar[bool] = False
    packed: ClassVar[bool] = True
    shared: SharedDirections | None = None
    member: int = 0
    key_norms: torch.Tensor | None = None
    value_norms: torch.Tensor | None = None
    retained_keys: torch.Tensor | None = None
    retained_values: torch.Tensor | None = None
    tail_keys: torch.Tensor | None = None
    tail_values: torch.Tensor | None = None

    def __init__(
        self,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        window: int | None = None,
        shared: SharedDirections | None = None,
        member: int = 0,
        key_norms: torch.Tensor | None = None,
        value_norms: torch.Tensor | None = None,
        retained_keys: torch.Tensor | None = None,
        retained_values: torch.Tensor | None = None,
        tail_keys: torch.Tensor | None = None,
        tail_values: torch.Tensor | None = None,
    ):
        if window is not None:
            raise InvalidInputError("sliding-window layers are not merged")
        if token_index is None or positions is None:
            raise InvalidInputError("MergedLayerKV needs token_index and positions")
        if tail_keys is None or tail_values is None:
            raise InvalidInputError(
                "MergedLayerKV needs its tail keys and values (use ops.minicache)"
            )
        if member not in (0, 1):
            raise InvalidInputError(f"member must be 0 or 1, not {member!r}")
        self.token_index = token_index
        self.positions = positions
        self.bias = bias
        self.window = None
        self.member = member
        self.shared = shared
        self.key_norms, self.value_norms = key_norms, value_norms
        self.retained_keys, self.retained_values = retained_keys, retained_values
        self.tail_keys, self.tail_values = tail_keys, tail_values
        if shared is None:
            self._detach(tail_keys, tail_values)
        elif any(t is None for t in (key_norms, value_norms, retained_keys, retained_values)):
            raise InvalidInputError("a merged layer needs its norms and retained entries")
        if keys is not None or values is not None:
            self._adopt(keys, values)

    # ------------------------------------------------------------ construction helpers

    def _detach(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Leave the pair: every entry exact, in the tail."""
        b, h, _, d = keys.shape
        self.shared = None
        self.key_norms = keys.new_zeros(b, h, 0)
        self.value_norms = values.new_zeros(b, h, 0)
        self.retained_keys = keys.new_zeros(b, h, 0, d)
        self.retained_values = values.new_zeros(b, h, 0, values.shape[-1])
        self.tail_keys, self.tail_values = keys, values

    def _adopt(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        """Hold ``keys`` / ``values`` (dense, all entries; None: as now), keeping the merged
        part where it is unchanged."""
        m = self.n_merged
        if m:
            mk, mv = self._merged_part()
            same = all(
                x is None
                or (
                    x.shape[-2] >= m
                    and x.shape[:2] == mine.shape[:2]
                    and torch.equal(x[:, :, :m], mine.to(x.device, x.dtype))
                )
                for x, mine in ((keys, mk), (values, mv))
            )
        else:
            same = True
        device = (keys if keys is not None else values).device
        if same:
            if device != self.device:
                self._move(device)
            if keys is not None:
                self.tail_keys = _kept(keys[:, :, m:], self.tail_keys)
            if values is not None:
                self.tail_values = _kept(values[:, :, m:], self.tail_values)
            return
        full_k = keys if keys is not None else self.keys.to(device)
        full_v = values if values is not None else self.values.to(device)
        self._detach(full_k, full_v)

    def _move(self, device: torch.device) -> None:
        self.shared = None if self.shared is None else self.shared.to(device)
        for name in _OWN:
            setattr(self, name, getattr(self, name).to(device))

    # ------------------------------------------------------------ reading

    @property
    def n_merged(self) -> int:
        """Entries in the merged part (0 for a layer that left its pair)."""
        return 0 if self.shared is None else self.shared.n

    def __len__(self) -> int:
        return self.n_merged + self.tail_keys.shape[-2]

    @property
    def device(self) -> torch.device:
        return self.tail_keys.device

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = self.tail_keys.shape
        return b, h, len(self), d

    @property
    def value_shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = self.tail_values.shape
        return b, h, len(self), d

    def _merged_part(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values ``[batch, kv_heads, m, head_dim]`` on the merged part."""
        return self._rebuild("keys"), self._rebuild("values")

    def _rebuild(self, which: str) -> torch.Tensor:
        shared = self.shared
        directions = shared.keys if which == "keys" else shared.values
        norms = self.key_norms if which == "keys" else self.value_norms
        retained = self.retained_keys if which == "keys" else self.retained_values
        dtype = self.tail_keys.dtype if which == "keys" else self.tail_values.dtype
        out = (directions.dequantize().float() * norms.float()[..., None]).to(dtype)
        if shared.retained.numel():
            out[:, :, shared.retained.to(out.device)] = retained.to(dtype)
        return out

    def _dense(self, which: str, new: torch.Tensor | None = None) -> torch.Tensor:
        tail = self.tail_keys if which == "keys" else self.tail_values
        parts = [tail] if self.shared is None else [self._rebuild(which), tail]
        if new is not None:
            parts.append(new.to(tail.dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    @property
    def keys(self) -> torch.Tensor:
        return self._dense("keys")

    @property
    def values(self) -> torch.Tensor:
        return self._dense("values")

    def dense_kv(self, new_keys=None, new_values=None) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values rebuilt (``[batch, kv_heads, n (+ k), head_dim]``),
        ``new_keys`` / ``new_values`` appended when given."""
        return self._dense("keys", new_keys), self._dense("values", new_values)

    @property
    def nbytes(self) -> int:
        own = sum(
            t.numel() * t.element_size()
            for t in [getattr(self, name) for name in _OWN] + [self.bias]
            if t is not None
        )
        if self.shared is None:
            return own
        total = self.shared.nbytes
        return own + total // 2 + (total % 2 if self.member == 0 else 0)

    def __repr__(self) -> str:
        bits = None if self.shared is None else self.shared.bits
        r = 0 if self.shared is None else self.shared.retained.numel()
        return (
            f"MergedLayerKV(n={len(self)}, member={self.member}, merged={self.n_merged}, "
            f"retained={r}, bits={bits})"
        )

    # ------------------------------------------------------------ storage

    def to_tensors(self, cast=None) -> tuple[dict[str, torch.Tensor], dict]:
        """The layer's own tensors (norms, retained entries, tail; K/V data cast) and its
        params; the shared part comes from :meth:`shared_tensors`."""
        cast = cast or (lambda t, what: t)
        out = {
            "key_norms": cast(self.key_norms.to("cpu").contiguous(), "key norms"),
            "value_norms": cast(self.value_norms.to("cpu").contiguous(), "value norms"),
            "retained.keys": cast(self.retained_keys.to("cpu").contiguous(), "keys"),
            "retained.values": cast(self.retained_values.to("cpu").contiguous(), "values"),
            "tail.keys": cast(self.tail_keys.to("cpu").contiguous(), "keys"),
            "tail.values": cast(self.tail_values.to("cpu").contiguous(), "values"),
        }
        params: dict = {"member": self.member, "shared": None}
        if self.shared is not None:
            params.update(
                shared=self.shared.uid,
                bits=self.shared.bits,
                key_group=self.shared.keys.group,
                value_group=self.shared.values.group,
            )
        return self._bookkeeping(out), params

    def shared_tensors(self, cast=None) -> tuple[str, dict[str, torch.Tensor]] | None:
        if self.shared is None:
            return None
        return self.shared.uid, self.shared.tensors(cast)

    @classmethod
    def from_tensors(cls, tensors, params, window, device, dtype) -> MergedLayerKV:
        try:
            shared = None
            uid = params.get("shared")
            if uid is not None:
                bits = int(params["bits"])
                if bits not in (0, *BITS):
                    raise ValueError(f"bits {bits}")
                groups = (int(params["key_group"]), int(params["value_group"]))
                mine = {
                    k[len("shared.") :]: t for k, t in tensors.items() if k.startswith("shared.")
                }
                shared = SharedDirections.from_tensors(str(uid), mine, bits, groups, device, dtype)
            bias = tensors.get("bias")
            layer = cls(
                token_index=tensors["token_index"],
                positions=tensors["positions"],
                bias=None if bias is None else bias.to(device),
                window=window,
                shared=shared,
                member=int(params["member"]),
                key_norms=tensors["key_norms"].to(device, dtype),
                value_norms=tensors["value_norms"].to(device, dtype),
                retained_keys=tensors["retained.keys"].to(device, dtype),
                retained_values=tensors["retained.values"].to(device, dtype),
                tail_keys=tensors["tail.keys"].to(device, dtype),
                tail_values=tensors["tail.values"].to(device, dtype),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCacheError(f"a merged layer is malformed: {e}") from e
        if shared is not None:
            m, r = shared.n, shared.retained.numel()
            b, h, _, d = layer.tail_keys.shape
            dv = layer.tail_values.shape[-1]
            problems = [
                name
                for name, found, shape in (
                    ("key_norms", layer.key_norms.shape, (b, h, m)),
                    ("value_norms", layer.value_norms.shape, (b, h, m)),
                    ("retained.keys", layer.retained_keys.shape, (b, h, r, d)),
                    ("retained.values", layer.retained_values.shape, (b, h, r, dv)),
                    ("key directions", shared.keys.shape, (b, h, m, d)),
                    ("value directions", shared.values.shape, (b, h, m, dv)),
                )
                if tuple(found) != shape
            ]
            if problems or (r and int(shared.retained.max()) >= m):
                raise CorruptCacheError(f"a merged layer's parts do not fit: {problems}")
        return layer

    # ------------------------------------------------------------ edits

    def _parts(self, **changes) -> MergedLayerKV:
        fields = {name: getattr(self, name) for name in _OWN}
        fields.update(
            token_index=self.token_index,
            positions=self.positions,
            bias=self.bias,
            shared=self.shared,
            member=self.member,
        )
        fields.update(changes)
        return MergedLayerKV(**fields)

    def map(self, fn) -> MergedLayerKV:
        changes = {name: fn(getattr(self, name)) for name in _OWN}
        return self._parts(
            token_index=fn(self.token_index),
            positions=fn(self.positions),
            bias=None if self.bias is None else fn(self.bias),
            shared=None if self.shared is None else self.shared.map(fn),
            **changes,
        )

    def select(self, entries: torch.Tensor | slice) -> LayerKV:
        """The layer holding only ``entries``: still merged when they keep the whole merged
        part in order (a cut of the tail), else a dense layer."""
        idx = torch.arange(len(self))[entries] if isinstance(entries, slice) else entries.cpu()
        m = self.n_merged
        if idx.numel() < m or not torch.equal(idx[:m], torch.arange(m)):
            return super().select(entries)
        rest = idx[m:] - m
        if rest.numel() and int(rest.min()) < 0:
            return super().select(entries)
        r = rest.to(self.tail_keys.device)
        return self._parts(
            token_index=self.token_index[idx],
            positions=self.positions[idx],
            bias=None if self.bias is None else self.bias[..., idx.to(self.bias.device)],
            tail_keys=self.tail_keys[:, :, r],
            tail_values=self.tail_values[:, :, r],
        )

    def append(self, keys, values, token_index, positions, bias=None) -> MergedLayerKV:
        """Entries appended to the exact tail (bias as :meth:`LayerKV.append`)."""
        index, pos, new_bias = self.appended_bookkeeping(
            keys.shape[-2], token_index, positions, bias
        )
        return self._parts(
            token_index=index,
            positions=pos,
            bias=new_bias,
            tail_keys=torch.cat([self.tail_keys, keys.to(self.tail_keys.dtype)], dim=-2),
            tail_values=torch.cat([self.tail_values, values.to(self.tail_values.dtype)], dim=-2),
        )

    def extended(self, full_keys, full_values, token_index, positions) -> MergedLayerKV:
        """The new entries of ``full_keys/values`` (after this layer's) appended exactly."""
        n = len(self)
        return self.append(full_keys[:, :, n:], full_values[:, :, n:], token_index, positions)


def _kept(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``old`` when ``new`` holds the same entries, else a copy of ``new`` (a slice of a
    rebuilt layer must not keep the whole layer alive)."""
    if new.shape == old.shape and new.device == old.device and torch.equal(new, old):
        return old
    return new.clone()


_OWN = (
    "key_norms",
    "value_norms",
    "retained_keys",
    "retained_values",
    "tail_keys",
    "tail_values",
)
