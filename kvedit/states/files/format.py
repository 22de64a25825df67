"""The state file format: its name, versions, and the CRC-32 files before version 4 carry.

A state file is one safetensors file with JSON metadata in its header. Layout: per layer ``i``,
the tensors its cache-layer class writes (:mod:`kvedit.cache`), named ``layer.{i}.NAME`` (dense:
``keys`` / ``values`` ``[batch, kv_heads, n_i, head_dim]``, ``token_index`` / ``positions``
``[n_i]``, optional ``bias`` ``[batch, heads, n_i]``; quantized: packed codes, scales, zero
points and the exact residual; merged: norms, retained entries and the exact tail),
``shared.{key}.NAME`` for data layers share (a merged pair's directions, written once, named by
the layers' ``shared`` param), ``attached.NAME`` for tensors the state's holder keeps beside it
(a forgetting memory's entry scores), and ``token_ids``, ``offsets``, ``position_ids``,
``last_logits``.
The header's ``kvedit`` entry is JSON: format version, fingerprints, text, windows, each layer's
kind and parameters, and the file's ``seal`` (:mod:`kvedit.states.files.seal`: a digest of the
header and one of every tensor, and this installation's MAC of both).

Format versions: 4 replaces the CRC-32 of the tensors with the seal: a file whose seal this
installation cannot verify (written elsewhere, or by a kvedit before version 4) loads with an
unknown history, so the store and vLLM never take it for a capture. 3 (kvedit 0.3) adds the state's provenance: ``history`` (its origin and
every transformation, :class:`kvedit.provenance.History`, the cast of a ``save(dtype=...)``
included), ``kv_dtype`` (the dtype its keys and values are written in) and ``last_input``
(``[token index, position]`` of the entry its last logits follow). 2 (kvedit 0.2) records the
model fingerprint of :func:`kvedit.fingerprint.model_fingerprint` (whole tensors,
dtype-independent), the token count and each layer's entry count. Versions 1 (kvedit 0.1)
to 3 are still read (their CRC-32 checked); their states have an unknown history.
"""

from __future__ import annotations

import zlib

import torch

__all__ = [
    "ATTACHED",
    "FORMAT",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "SEALED_VERSION",
    "crc32_of",
]

ATTACHED = "attached."
"""The prefix of the tensors a state's holder stores beside it (``save_file_version(attached=)``)."""

FORMAT = "kvedit.kvstate"
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
# The first version whose files carry a seal instead of a CRC-32.
SEALED_VERSION = 4


def crc32_of(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 over the tensors' names and bytes, in name order (hex)."""
    crc = 0
    for name in sorted(tensors):
        crc = crc32_step(crc, name, tensors[name])
    return f"{crc:08x}"


def crc32_step(crc: int, name: str, tensor: torch.Tensor) -> int:
    """``crc`` continued over one tensor's name and bytes: :func:`crc32_of` one tensor at a
    time (call it in name order)."""
    t = tensor.contiguous()
    crc = zlib.crc32(name.encode(), crc)
    if t.numel():
        crc = zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy()), crc)
    return crc
