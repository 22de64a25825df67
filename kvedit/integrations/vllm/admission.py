"""Which published cache a request is served from, or why it is refused.

One decision, shared by the connector's scheduler side
(:meth:`~kvedit.integrations.vllm.connector.KVEditConnector.get_num_new_matched_tokens`) and
``kvedit serve``'s request check (:mod:`~kvedit.integrations.vllm.request_check`, which answers
a refusal to the client before vLLM sees the request). Needs no vLLM.

A request is served from the published cache whose digest it names
(``kv_transfer_params={"kvedit": {"digest": D}}``) and whose ids start its prompt, or, when it
names none, from a plain capture published for the longest published prefix of its prompt.
Everything else is a :class:`Refusal` with a reason (its HTTP status in :data:`STATUS`):

* ``bad-request``: malformed kvedit parameters;
* ``unknown-digest``: no file with the named digest starts the prompt;
* ``digest-required``: no digest named and the prompt's published prefix is only published as
  edited states;
* ``prefix-cache``: the prompt already hit vLLM's prefix cache (whose blocks may hold another
  cache's entries);
* ``whole-prompt``: the prompt is exactly the published ids of an edited state (vLLM must
  compute one token, and the last slot computed from its token id is not the edited entry);
* ``missing``, ``corrupt``, ``mismatch`` (a file the engine cannot serve: another model's, other
  shapes), ``root`` (the publish root cannot be listed).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import KVEditError
from . import files

__all__ = [
    "STATUS",
    "Admitted",
    "Refusal",
    "admit",
    "fingerprint_problem",
    "requested_digest",
    "requested_turn",
]

STATUS: dict[str, int] = {
    "bad-request": 400,
    "digest-required": 400,
    "whole-prompt": 400,
    "unknown-digest": 404,
    "mismatch": 409,
    "prefix-cache": 409,
    "missing": 500,
    "corrupt": 500,
    "root": 500,
}
"""The HTTP status ``kvedit serve`` answers each refusal reason with: the client's mistake
(400, 404), a file this server cannot serve (409), a fault on the server's side (500)."""

Check = Callable[[dict], "str | None"]
"""Why the engine cannot serve a published file's header, or None."""


@dataclass(frozen=True)
class Admitted:
    """Serve the request's first ``n`` prompt tokens from ``path`` (header ``meta``)."""

    path: Path
    n: int
    meta: dict = field(repr=False)


@dataclass(frozen=True)
class Refusal:
    """Why a request is not served from a published cache.

    Attributes:
        reason: one of :data:`STATUS`'s keys.
        detail: what was wrong, naming the file or the digest.
        published: the tokens the request asked of a published cache (1 for a digest that is
            not there); 0 when it asked for none, so vLLM may compute its prompt as text.
        path: the file concerned, or "".
        digest: the digest the request named, or None.
    """

    reason: str
    detail: str
    published: int = 0
    path: str = ""
    digest: str | None = None

    @property
    def status(self) -> int:
        """The HTTP status of this refusal."""
        return STATUS[self.reason]

    @property
    def message(self) -> str:
        """One line for the client and the log."""
        return f"kvedit refused the request ({self.reason}): {self.detail}"


_KEYS = {"digest", "turn"}  # "turn": set by kvedit serve's chat memories, never by a client
_TURN = re.compile(r"[0-9a-f]{32}")


def requested_digest(params: object) -> tuple[str | None, str]:
    """``(the digest a request's kv_transfer_params name or None, why they are malformed)``."""
    own = params.get("kvedit") if isinstance(params, dict) else None
    if own is None:
        return None, ""
    if not isinstance(own, dict) or set(own) - _KEYS:
        return None, f'kv_transfer_params["kvedit"] must be {{"digest": ...}}, not {own!r}'
    turn = own.get("turn")
    if turn is not None and not (isinstance(turn, str) and _TURN.fullmatch(turn)):
        return None, f'kv_transfer_params["kvedit"]["turn"] must be 32 hex digits, not {turn!r}'
    digest = own.get("digest")
    if digest is None:
        return None, ""
    try:
        return files.check_digest(digest), ""
    except KVEditError as e:
        return None, str(e)


def requested_turn(params: object) -> str | None:
    """The turn id a chat memory's request carries (its K/V are saved under it), or None.
    Malformed parameters give None here; :func:`requested_digest` refuses them."""
    own = params.get("kvedit") if isinstance(params, dict) else None
    turn = own.get("turn") if isinstance(own, dict) else None
    return turn if isinstance(turn, str) and _TURN.fullmatch(turn) else None


def fingerprint_problem(meta: dict, fingerprint: str | None) -> str | None:
    """Why a file whose header is ``meta`` was made by another model than ``fingerprint``'s."""
    found = meta.get("model_fingerprint")
    if fingerprint and found and found != fingerprint:
        return f"made by model {found}, the engine runs {fingerprint}"
    return None


def _plain(
    n: int, paths: dict[str, Path], fingerprint: str | None
) -> tuple[Path | None, dict, Refusal | None]:
    """For a request naming no digest: the plain capture among the files published for its
    ``n`` leading ids (one made by ``fingerprint``'s model first), or why there is none."""
    plain: list[tuple[Path, dict]] = []
    errors: list[str] = []
    for _digest, path in sorted(paths.items()):
        try:
            meta = files.read_header(path)
        except (KVEditError, OSError) as e:
            errors.append(f"{path.name}: {e}")
            continue
        if meta.get("plain_capture") is True and meta.get("trusted") is True:
            plain.append((path, meta))
    if plain:
        plain.sort(key=lambda pm: pm[1].get("model_fingerprint") != fingerprint)
        return plain[0][0], plain[0][1], None
    first = str(next(iter(sorted(paths.values()))))
    if errors and len(errors) == len(paths):
        return None, {}, Refusal("corrupt", "; ".join(errors), n, first)
    detail = (
        f"the request names no digest and its {n} leading ids are published only as edited "
        f"states (digests {', '.join(sorted(paths))}); name one: kv_transfer_params "
        '{"kvedit": {"digest": ...}} (kvedit publish prints it)'
    )
    return None, {}, Refusal("digest-required", detail, n, first)


def admit(
    index: files.PublishedIndex,
    ids: list[int],
    params: object,
    *,
    check: Check,
    fingerprint: str | None = None,
    computed: int = 0,
) -> Admitted | Refusal | None:
    """Decide a request (see the module doc).

    Args:
        index: the publish root's index.
        ids: the request's prompt token ids.
        params: its ``kv_transfer_params`` (None when it has none).
        check: why the engine cannot serve a file's header, or None (shapes; the model
            fingerprint is checked by :func:`fingerprint_problem`).
        fingerprint: the kvedit fingerprint of the served model, or None.
        computed: prompt tokens vLLM's prefix cache already holds.

    Returns:
        :class:`Admitted`, a :class:`Refusal`, or None when no published cache starts the
        prompt and none was asked for (vLLM computes it).
    """
    digest, bad = requested_digest(params)
    if bad:
        return Refusal("bad-request", bad, 1)
    try:
        if digest is not None:
            found = index.find(ids, digest)
            if found is None:
                detail = (
                    f"no cache with digest {digest} published under {index.root} starts this prompt"
                )
                return Refusal("unknown-digest", detail, 1, digest=digest)
            path, n = found
            meta: dict = {}
        else:
            candidates = index.candidates(ids)
            if candidates is None:
                return None
            n, paths = candidates
            found_path, meta, refusal = _plain(n, paths, fingerprint)
            if found_path is None:
                return refusal
            path = found_path
    except OSError as e:
        named = int(digest is not None)  # a request for a published cache fails
        return Refusal("root", f"cannot list {index.root}: {e}", named, digest=digest)
    where = str(path)
    try:
        if not meta:
            meta = files.read_header(path)
    except FileNotFoundError:
        return Refusal("missing", f"{path} was removed after the lookup", n, where, digest)
    except (KVEditError, OSError) as e:
        return Refusal("corrupt", str(e), n, where, digest)
    if meta.get("token_ids") != ids[:n] or meta.get("digest") != files.digest_of(path):
        detail = f"{path.name}: token ids or digest differ from its name"
        return Refusal("corrupt", detail, n, where, digest)
    why = check(meta) or fingerprint_problem(meta, fingerprint)
    if why is not None:
        return Refusal("mismatch", f"{path.name}: {why}", n, where, digest)
    if computed > 0:
        detail = (
            f"{computed} tokens already hit vLLM's prefix cache; its blocks may hold another "
            "cache's entries (turn prefix caching off)"
        )
        return Refusal("prefix-cache", detail, n, where, digest)
    if n >= len(ids) and not (meta.get("plain_capture") is True and meta.get("trusted") is True):
        detail = (
            f"the prompt is exactly the {n} published ids: vLLM would compute the last slot "
            "from its token id, which is not the edited cache's entry; send the question (at "
            "least one token) after them"
        )
        return Refusal("whole-prompt", detail, n, where, digest)
    return Admitted(path, n, meta)
