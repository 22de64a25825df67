"""Entry records: what the store keeps about each entry, and which states may become one.

An entry's record (:class:`EntryMeta`; :meth:`~EntryMeta.to_json` and
:meth:`~EntryMeta.from_json`, as every persisted record of kvedit) is its ``KEY.json`` on disk
and rides along with its state in memory: the key, token count, who made it, the chain hashes it is indexed under,
whether it can be cut at an earlier chunk boundary, its size, pin and expiry.
:func:`check_storable` decides which states the store accepts (plain captures only, by their
history and their tensors), and
:func:`check_fingerprints` that a record was made by the caller's model and tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel

from ..cache import LAYER_CLASSES
from ..errors import CacheMismatchError, NotACaptureError
from ..states.state import KVState
from .keys import STORE_FORMAT, chain_root, chunk_hashes, is_key, tail_key

__all__ = ["EntryMeta", "check_fingerprints", "check_storable", "storable_problem"]


@dataclass(frozen=True)
class EntryMeta:
    """The index record of one entry (``KEY.json``).

    Attributes:
        key: the content key.
        n_tokens: number of tokens of the stored state.
        model_fingerprint, tokenizer_fingerprint: who made it.
        chunk_hashes: ``[h_1 .. h_m]``, the chain hashes of its full chunks.
        cuttable: whether the state can be cut at an earlier chunk boundary (every layer holds
            every token it would need).
        file_bytes: size of the ``.kv`` file (0 for an entry only in memory).
        created: unix time of the first put.
        expires: unix time after which the entry is not served (None: never).
        pinned: pinned entries are never evicted and never expire.
    """

    key: str
    n_tokens: int
    model_fingerprint: str
    tokenizer_fingerprint: str
    chunk_hashes: tuple[str, ...]
    cuttable: bool
    file_bytes: int
    created: float
    expires: float | None = None
    pinned: bool = False

    @classmethod
    def build(
        cls,
        ids: Sequence[int],
        model_fp: str,
        tokenizer_fp: str,
        layer_lengths: Iterable[int],
        chunk: int,
        *,
        file_bytes: int,
        created: float,
        expires: float | None = None,
    ) -> EntryMeta:
        """The record of a state of token ``ids`` whose layers hold ``layer_lengths`` entries,
        keyed and indexed with ``chunk`` ids per hashed chunk."""
        hashes = chunk_hashes(chain_root(model_fp, tokenizer_fp), ids, chunk)
        return cls(
            key=tail_key(hashes[-1], ids[(len(hashes) - 1) * chunk :]),
            n_tokens=len(ids),
            model_fingerprint=model_fp,
            tokenizer_fingerprint=tokenizer_fp,
            chunk_hashes=tuple(hashes[1:]),
            cuttable=all(n == len(ids) for n in layer_lengths),
            file_bytes=file_bytes,
            created=created,
            expires=expires,
        )

    def expired(self, now: float) -> bool:
        """Whether the entry is past its expiry at unix time ``now`` (never when pinned)."""
        return not self.pinned and self.expires is not None and now >= self.expires

    def levels(self) -> list[str]:
        """``[h_0, h_1, ..., h_m]``: the chain hashes this entry is indexed under."""
        return [chain_root(self.model_fingerprint, self.tokenizer_fingerprint), *self.chunk_hashes]

    def to_json(self) -> dict:
        """The record as ``KEY.json`` holds it (JSON-ready: ``format`` and the fields by
        name; :class:`~kvedit.store.disk.DiskTier` writes it with sorted keys)."""
        return {"format": f"{STORE_FORMAT}.entry", **asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping) -> EntryMeta:
        """The record :meth:`to_json` wrote, checked; raises ValueError on anything malformed
        (not a mapping, another ``format``, a missing or unknown field, a bad key or count)."""
        try:
            data = dict(data)
            if data.pop("format") != f"{STORE_FORMAT}.entry":
                raise ValueError("not a kvedit store entry record")
            data["chunk_hashes"] = tuple(data["chunk_hashes"])
            meta = cls(**data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed entry record: {e}") from e
        if not is_key(meta.key) or meta.n_tokens <= 0:
            raise ValueError("malformed entry record")
        return meta


def storable_problem(state: KVState, allowed_casts: Sequence = ()) -> str | None:
    """Why the store may not hold (or serve) ``state``, or None: its history must be a plain
    capture (:meth:`History.first_change <kvedit.provenance.History.first_change>`: a capture
    with nothing done to it but exact casts, or casts to a dtype of ``allowed_casts``). The
    phrase names the first transformation."""
    change = state.history.first_change(allowed_casts)
    return None if change is None else f"its history shows {change}"


def check_storable(state: KVState, allowed_casts: Sequence = ()) -> None:
    """Only plain captures are content-addressed: the key (a function of the token ids) says
    nothing about edits.

    The state's history must be a plain capture (:func:`storable_problem`): a capture with
    nothing done to it but exact casts, or casts to a dtype in ``allowed_casts``; a state with
    an unknown history (a file written before kvedit 0.3) is refused too. Then, as a check of
    the tensors themselves, a storable state of ``n`` tokens has ``position_ids == arange(n)``
    (``[n]``) and ``next_position == n``; every layer is of a registered lossless kind
    (:mod:`kvedit.cache`) without a bias whose ``token_index`` and ``positions``
    (``[len(layer)]``) are its last ``len(layer)`` tokens in order, a global layer (no window)
    holds all ``n``, and the last logits follow the last token.

    Raises:
        NotACaptureError: the state is not such a capture (the message names the first
            transformation in its history, or the first problem with its tensors).
    """
    n = len(state)
    problems = []
    change = storable_problem(state, allowed_casts)
    if change is not None:
        problems.append(change)
    elif state.next_position != n or not torch.equal(state.position_ids, torch.arange(n)):
        problems.append("positions are not 0..n-1")
    for i, layer in enumerate(state.layers):
        if problems:
            break
        if layer.kind not in LAYER_CLASSES or not layer.lossless:
            problems.append(f"layer {i} is a lossy {layer.kind!r} layer ({type(layer).__name__})")
            break
        tail = torch.arange(n - len(layer), n)
        if layer.bias is not None:
            problems.append(f"layer {i} has a bias")
        elif not (torch.equal(layer.token_index, tail) and torch.equal(layer.positions, tail)):
            problems.append(f"layer {i} entries are not one per token in order")
        elif layer.window is None and len(layer) != n:
            problems.append(f"global layer {i} does not hold every token")
        if problems:
            break
    if problems:
        raise NotACaptureError(
            "KVStore holds unedited captures only (an edited cache is not determined by its "
            f"tokens, so it cannot be content-addressed): {problems[0]}"
        )
    last = state.last_input
    if n and (last.token_index, last.position) != (n - 1, n - 1):
        raise NotACaptureError(
            "KVStore holds unedited captures only: the last logits follow token "
            f"{last.token_index} at position {last.position}, not the last token"
        )


def check_fingerprints(meta: EntryMeta, fps: tuple[str, str], model: PreTrainedModel) -> None:
    """Raise :class:`~kvedit.errors.CacheMismatchError` unless ``meta`` was made by the model and
    tokenizer whose fingerprints are ``fps`` (``model`` only names it in the message)."""
    if (meta.model_fingerprint, meta.tokenizer_fingerprint) != fps:
        raise CacheMismatchError(
            f"store entry {meta.key} was made by another model or tokenizer "
            f"(model {getattr(model, 'name_or_path', '?')!r})"
        )
