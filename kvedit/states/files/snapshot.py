"""One version of a safetensors file, read through one open file.

A writer replaces a kvedit file atomically (:func:`kvedit.atomic.atomic_write`: a new file
renamed onto the name), so a reader that opens the name twice (once for the header, once for
the tensors, as ``safetensors.safe_open`` does) can read the header of one version and the
tensors of the next: a whole file reported corrupt while another process saves it.
:func:`read_snapshot` opens the file once and reads everything from that descriptor (the
length prefix, the JSON header, every tensor's bytes), so it reads the version it opened,
whatever is renamed onto the name meanwhile. It parses the format itself (an 8-byte
little-endian header length, the JSON header naming each tensor's dtype, shape and byte range,
then the data) and never unpickles anything.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import CorruptCacheError

__all__ = ["DTYPES", "MAX_HEADER", "FileSnapshot", "read_snapshot"]

MAX_HEADER = 100 * 2**20
"""The largest JSON header read (safetensors' own limit)."""

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""The safetensors dtype names this reader knows, as torch dtypes."""


@dataclass(frozen=True)
class FileSnapshot:
    """What one open of a safetensors file read: the header's ``metadata`` (its
    ``__metadata__`` strings), every tensor by name, and the ``version`` of the file read
    (``(device, inode, size, mtime_ns, ctime_ns)`` of the open descriptor, before and after
    the read: ``changed`` when the file was written in place meanwhile)."""

    metadata: dict[str, str]
    tensors: dict[str, torch.Tensor]
    version: tuple[int, int, int, int, int]
    changed: bool = False


def _version(fd: int) -> tuple[int, int, int, int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read_exactly(f, n: int, path) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = f.read(n - len(out))
        if not chunk:
            raise CorruptCacheError(f"{path}: truncated: the file ends inside its header")
        out += chunk
    return bytes(out)


def _sniff(path, head: bytes, size: int) -> int:
    """The header length of a plausible safetensors file (its first 9 bytes ``head``, its
    ``size``); otherwise what the file is, as a :class:`CorruptCacheError`. The first byte
    alone proves nothing (a header length can end in 0x80)."""
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else 0
    if len(head) == 9 and head[8:9] == b"{" and 0 < n <= MAX_HEADER and 8 + n <= size:
        return n
    if head[:1] == b"\x80" or head[:2] == b"PK":
        raise CorruptCacheError(
            f"{path}: looks like a pickle or torch.save archive; kvedit never unpickles files"
        )
    if len(head) < 9:
        raise CorruptCacheError(f"{path}: truncated ({size} bytes), not a safetensors file")
    raise CorruptCacheError(f"{path}: bad or truncated safetensors header (length {n})")


def _sizes(value) -> bool:
    """Whether ``value`` is a JSON list of non-negative ints."""
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _entry(name: str, entry, room: int) -> tuple[torch.dtype, list[int], int, int]:
    """``(dtype, shape, begin, end)`` of one header entry, checked against the data's size
    (``room`` bytes)."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name!r}: malformed entry {entry!r}")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"tensor {name!r}: unknown dtype {entry['dtype']!r}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not _sizes(shape):
        raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
    if not _sizes(offsets) or len(offsets) != 2:
        raise ValueError(f"tensor {name!r}: bad data offsets {offsets!r}")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if not begin <= end <= room or end - begin != numel * itemsize:
        raise ValueError(
            f"tensor {name!r}: {shape} {entry['dtype']} does not fit bytes {begin}..{end} of {room}"
        )
    return dtype, shape, begin, end


def _tensor(f, start: int, dtype: torch.dtype, shape: list[int], nbytes: int) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    f.seek(start)
    done = 0
    while done < nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise ValueError("the file ends inside a tensor")
        done += got
    return buf.view(dtype).reshape(shape)


def read_snapshot(path: Path) -> FileSnapshot:
    """The header metadata and every tensor of the safetensors file at ``path``, read through
    one open descriptor (module docstring).

    Raises:
        CorruptCacheError: not a safetensors file (a pickle, a zip, truncated, a malformed
            header or a tensor outside the data), or unreadable.
        FileNotFoundError: there is no file at ``path``.
    """
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CorruptCacheError(f"{path}: cannot read: {e}") from e
    with f:
        try:
            before = _version(f.fileno())
            size = before[2]
            n = _sniff(path, f.read(9), size)
            f.seek(8)
            header = json.loads(_read_exactly(f, n, path))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            metadata = header.pop("__metadata__", None) or {}
            if not isinstance(metadata, dict) or not all(
                isinstance(v, str) for v in metadata.values()
            ):
                raise ValueError("the header's __metadata__ is not a map of strings")
            tensors = {}
            for name, entry in header.items():
                dtype, shape, begin, end = _entry(name, entry, size - 8 - n)
                tensors[name] = _tensor(f, 8 + n + begin, dtype, shape, end - begin)
            after = _version(f.fileno())
        except CorruptCacheError:
            raise
        except (ValueError, OSError, UnicodeDecodeError, RuntimeError) as e:
            raise CorruptCacheError(f"{path}: unreadable safetensors file: {e}") from e
    return FileSnapshot(metadata, tensors, before, changed=after != before)
