"""The merged cache layer: one layer of a pair that shares its K/V directions (MiniCache).

See :func:`kvedit.compress.minicache` for how a state gets these layers. A *pair* of
layers ``(l, l + 1)`` holding the same entries stores, for its first ``m`` entries, one unit
direction per entry and KV head for both layers (:class:`~kvedit.cache.directions.SharedDirections`,
written once), and per layer (:class:`MergedLayerKV`, one per decoder layer, ``member`` 0 or 1):

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

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CorruptCacheError, InvalidInputError
from .directions import SharedDirections
from .packed import BITS, PackedLayerKV
from .registry import register_layer

__all__ = ["MergedLayerKV"]


@register_layer
@dataclass(init=False, repr=False, eq=False, frozen=True)
class MergedLayerKV(PackedLayerKV):
    """One layer of a merged pair (see the module doc), a global layer.

    ``keys`` and ``values`` are rebuilt on every access (:meth:`dense_kv`). Constructed from
    its parts, or, as other ops do (``dataclasses.replace(layer, keys=k)``), from dense
    ``keys``/``values``: when they equal the layer's merged part, it is kept (a change after
    it goes to the exact tail); when an op changed merged entries (``scale_keys`` on them, a
    move), the layer leaves the pair and holds the op's result exactly, all in its tail
    (``shared`` None).

    ``nbytes`` counts the layer's own tensors and half of the shared part (member 0 the odd
    byte), so a state holding both members counts the pair once. Frozen, as every layer
    (:class:`~kvedit.cache.LayerKV`).
    """

    kind: ClassVar[str] = "merged"
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
        parts = {
            "shared": shared,
            "key_norms": key_norms,
            "value_norms": value_norms,
            "retained_keys": retained_keys,
            "retained_values": retained_values,
            "tail_keys": tail_keys,
            "tail_values": tail_values,
        }
        if shared is None:
            parts = _detached(tail_keys, tail_values)
        elif any(t is None for t in (key_norms, value_norms, retained_keys, retained_values)):
            raise InvalidInputError("a merged layer needs its norms and retained entries")
        if keys is not None or values is not None:
            base = MergedLayerKV(
                token_index=token_index, positions=positions, bias=bias, member=member, **parts
            )
            parts = base._adopted(keys, values)
        self._init_fields(
            token_index=token_index,
            positions=positions,
            bias=bias,
            window=None,
            member=member,
            **parts,
        )

    # ------------------------------------------------------------ construction helpers

    def _adopted(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> dict:
        """The parts (``shared`` and :data:`_OWN`) of this layer holding ``keys`` /
        ``values`` instead (dense, all entries; None: as now), keeping the merged part where
        it is unchanged."""
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
            parts = {name: getattr(self, name) for name in _OWN}
            parts["shared"] = self.shared
            if device != self.device:
                parts = {name: t.to(device) for name, t in parts.items() if name != "shared"}
                parts["shared"] = None if self.shared is None else self.shared.to(device)
            if keys is not None:
                parts["tail_keys"] = _kept(keys[:, :, m:], parts["tail_keys"])
            if values is not None:
                parts["tail_values"] = _kept(values[:, :, m:], parts["tail_values"])
            return parts
        full_k = keys if keys is not None else self.keys.to(device)
        full_v = values if values is not None else self.values.to(device)
        return _detached(full_k, full_v)

    # ------------------------------------------------------------ reading

    @property
    def n_merged(self) -> int:
        """Entries in the merged part (0 for a layer that left its pair)."""
        return 0 if self.shared is None else self.shared.n

    @property
    def n_packed(self) -> int:
        """The merged part's entries (the exact tail follows them)."""
        return self.n_merged

    @property
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``tail_keys`` and ``tail_values`` ``[batch, kv_heads, n - n_merged, head_dim]``."""
        return self.tail_keys, self.tail_values

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

    def with_tail(
        self,
        token_index: torch.Tensor,
        positions: torch.Tensor,
        bias: torch.Tensor | None,
        tail_keys: torch.Tensor,
        tail_values: torch.Tensor,
    ) -> MergedLayerKV:
        """The same pair member (norms, retained entries, shared part), followed by
        ``tail_keys`` / ``tail_values`` (see :meth:`PackedLayerKV.with_tail`)."""
        return self._parts(
            token_index=token_index,
            positions=positions,
            bias=bias,
            tail_keys=tail_keys,
            tail_values=tail_values,
        )

    def map(self, fn) -> MergedLayerKV:
        changes = {name: fn(getattr(self, name)) for name in _OWN}
        return self._parts(
            token_index=fn(self.token_index),
            positions=fn(self.positions),
            bias=None if self.bias is None else fn(self.bias),
            shared=None if self.shared is None else self.shared.map(fn),
            **changes,
        )


def _detached(keys: torch.Tensor, values: torch.Tensor) -> dict:
    """The parts (``shared`` and :data:`_OWN`) of a layer that left its pair: every entry
    exact, in the tail (``keys`` / ``values`` ``[batch, kv_heads, n, head_dim]``)."""
    b, h, _, d = keys.shape
    return {
        "shared": None,
        "key_norms": keys.new_zeros(b, h, 0),
        "value_norms": values.new_zeros(b, h, 0),
        "retained_keys": keys.new_zeros(b, h, 0, d),
        "retained_values": values.new_zeros(b, h, 0, values.shape[-1]),
        "tail_keys": keys,
        "tail_values": values,
    }


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
