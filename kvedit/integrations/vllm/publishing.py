"""Publishing a state for vLLM: :func:`publish` and :func:`publish_stock`.

A state is realised on a stock kernel by the rule of :mod:`~kvedit.integrations.vllm.servable`
(exact, or approximate and labelled when asked, else refused before anything is written) and
written under the root (:mod:`~kvedit.integrations.vllm.files`), named by its token ids and its
digest: two states with the same ids and different digests (a plain capture and a
``scale_keys`` edit of it) never replace each other. A request names the digest it wants
(:attr:`PublishedIds.kv_transfer_params`); one that names none is served only from a plain
capture of its ids.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...errors import InvalidInputError
from ...states.state import KVState
from ...version import __version__
from . import files
from .servable import check, realize
from .stock import REMOVE_AT, StockCache

__all__ = ["PublishedIds", "kv_transfer_params", "publish", "publish_stock"]


def kv_transfer_params(digest: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` a request sends to be served from the published cache with
    ``digest`` (vLLM passes them to the connector; the response echoes the digest in
    ``kv_transfer_params["kvedit"]["digest"]``). Offline: ``SamplingParams(extra_args=
    {"kv_transfer_params": ...})``; over HTTP: the request body's ``"kv_transfer_params"``."""
    return {"kvedit": {"digest": files.check_digest(digest)}}


class PublishedIds(list):
    """The prompt token ids to send for a published cache (a ``list`` of ints), with what a
    request names and checks.

    Attributes:
        digest: the published state's digest (the file's name; what the request names).
        path: the published file.
        exact: whether vLLM attends over the file exactly as kvedit attends over the state.
        plain_capture: whether the state was a plain capture (a request naming no digest is
            served from it).
    """

    digest: str
    path: Path | None
    exact: bool
    plain_capture: bool

    def __init__(
        self,
        ids: Iterable[int] = (),
        digest: str = "",
        path: Path | None = None,
        exact: bool = False,
        plain: bool = False,
    ):
        # the defaults: a copy made as a list is (``dataclasses.asdict``, ``copy``) keeps ids only
        super().__init__(int(t) for t in ids)
        self.digest, self.path, self.exact, self.plain_capture = digest, path, exact, plain

    @property
    def kv_transfer_params(self) -> dict[str, Any]:
        """What a request sends to be served from this file (:func:`kv_transfer_params`)."""
        return kv_transfer_params(self.digest)

    def sampling_extra_args(self) -> dict[str, Any]:
        """``SamplingParams(extra_args=...)`` for an offline ``vllm.LLM``."""
        return {"kv_transfer_params": self.kv_transfer_params}


def publish_stock(
    state: KVState | StockCache,
    root: str | os.PathLike,
    *,
    remove_at: float = REMOVE_AT,
    approximate: bool = False,
) -> tuple[PublishedIds, StockCache, Path]:
    """:func:`publish`, also returning the :class:`StockCache` written (its ``report()`` and
    ``realizations``: the biases asked and realised) and the file's path.

    A :class:`StockCache` is published as it is, under the same rule: an approximate one only
    with ``approximate=True`` and only when it carries its approximation label (made by
    :func:`~kvedit.integrations.vllm.servable.realize` with ``approximate=True``)."""
    files.check_root(root)  # before any work: an empty root would be the current folder
    if isinstance(state, KVState):
        state.check_unaltered("publishing it")
        _, cache = realize(state, approximate=approximate, remove_at=remove_at)
    elif isinstance(state, StockCache):
        cache = state
        verdict = check(cache, approximate=approximate, remove_at=remove_at, what="the cache")
        steps = cache.history.steps if cache.history is not None else ()
        if not verdict.exact and not (steps and steps[-1].kind == "approximation"):
            raise InvalidInputError(
                "this approximate StockCache carries no approximation label: publish the state "
                "with approximate=True, or build the cache with "
                "kvedit.integrations.vllm.servable.realize(state, approximate=True)"
            )
    else:
        raise InvalidInputError(
            f"publish takes a KVState or a StockCache, not {type(state).__name__}"
        )
    path = files.write(cache, root, __version__)
    ids = PublishedIds(
        cache.token_ids, files.digest_of(path), path, cache.exact, cache.plain_capture
    )
    return ids, cache, path


def publish(
    state: KVState | StockCache,
    root: str | os.PathLike,
    *,
    remove_at: float = REMOVE_AT,
    approximate: bool = False,
) -> PublishedIds:
    """Store ``state`` (possibly edited) under ``root`` for
    :func:`~kvedit.integrations.vllm.engine`'s connector.

    Returns the prompt token ids to send for it (one per cache slot; copies an edit added carry
    their token's id; the question's ids follow them) as a :class:`PublishedIds`, which also
    carries the digest a request names::

        ids = publish(state, root)
        params = SamplingParams(temperature=0, extra_args=ids.sampling_extra_args())
        out = llm.generate({"prompt_token_ids": ids + question_ids}, params)
        assert out[0].kv_transfer_params["kvedit"]["digest"] == ids.digest

    The file is named by the ids and the state's digest: publishing the same state again
    replaces it (atomically); another state with the same ids gets its own file. Biases are
    realised on a stock kernel (see :mod:`~kvedit.integrations.vllm.stock`) by the rule of
    :mod:`~kvedit.integrations.vllm.servable`: an approximate realisation only with
    ``approximate=True`` (then the state's history gets an approximation step, so the digest
    says so); ``remove_at``: entries biased by ``-remove_at`` nats or less are removed.

    Raises:
        ModelNotAttachedError: the edit changed the entry count and the state has no model
            (moving keys needs it).
        InvalidInputError: the edit cannot be realised on vLLM at all, or only approximately
            without ``approximate=True`` (nothing is written); the state cannot be served by a
            stock kernel (per-head removal, a sliding-window layer too short); or ``root``
            cannot be used (empty: it would be the current folder). Temporary files a killed
            writer left in ``root`` are removed (see :mod:`~kvedit.integrations.vllm.files`).
        StorageError: the file cannot be written.
        StateAlteredError: a tensor of ``state`` was written in place after it was built.
    """
    return publish_stock(state, root, remove_at=remove_at, approximate=approximate)[0]
