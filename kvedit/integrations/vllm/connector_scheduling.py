"""The kvedit connector's scheduler side (vLLM's scheduler process): which published cache
serves a request, and which finished chat turns are saved.

:class:`Scheduling` holds what the scheduler decided per request and answers the scheduler's
calls of :class:`~kvedit.integrations.vllm.connector.KVEditConnector` (its module doc says what
each decision is): :meth:`Scheduling.match` (``get_num_new_matched_tokens``),
:meth:`Scheduling.allocated` (``update_state_after_alloc``), :meth:`Scheduling.metadata`
(``build_connector_meta``: the loads and saves the workers run next step) and
:meth:`Scheduling.finished` (``request_finished``). It shares no state with the worker side
(:mod:`~kvedit.integrations.vllm.connector_loading`,
:mod:`~kvedit.integrations.vllm.connector_saving`): what they do comes in
:class:`KVEditConnectorMetadata`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...errors import KVEditError
from . import files, saving, turns
from .admission import Refusal, admit, requested_turn

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KVEditConnectorMetadata", "LoadSpec", "Scheduling"]


@dataclass
class LoadSpec:
    """One request's load: prompt tokens ``[start, end)`` from ``path`` into ``block_ids`` (one
    list per KV-cache group)."""

    req_id: str
    path: str
    start: int
    end: int
    block_ids: tuple[list[int], ...]
    refused: str = ""
    """Why the scheduler refused the file (then the load fails on purpose), or ""."""


@dataclass
class KVEditConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[saving.SaveSpec] = field(default_factory=list)


@dataclass
class _Match:
    """The scheduler's decision for one request: serve ``path`` (``refused`` empty), or fail
    the request by a load of ``claim`` tokens from ``start`` that fails on purpose."""

    path: str
    published: int
    digest: str | None
    start: int
    claim: int
    refused: str = ""


class Scheduling:
    """The scheduler side's decisions (see the module doc).

    Args:
        root: the publish root.
        fingerprint: the kvedit model fingerprint files must carry (None: not checked).
        fail: ``kv_load_failure_policy == "fail"``.
        check: why the engine's model cannot hold a file's shapes (its header), or None.
        logger: vLLM's logger for the connector.
    """

    def __init__(
        self,
        root: Path,
        fingerprint: str | None,
        fail: bool,
        check: Callable[[dict], str | None],
        logger: logging.Logger,
    ) -> None:
        self.root, self.fingerprint, self.fail = root, fingerprint, fail
        self.check, self.logger = check, logger
        self.index = files.PublishedIndex(root)
        self.refusals: Counter[str] = Counter()
        self.served = 0
        self._matches: dict[str, _Match] = {}
        self._outcome: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, LoadSpec] = {}
        self._saves: list[saving.SaveSpec] = []  # finished turns for the next step

    def _refuse(self, request: Request, refusal: Refusal, computed: int = 0) -> tuple[int, bool]:
        """Refuse to serve ``request``. With ``kv_load_failure_policy="fail"`` and a request
        that asked for a published cache (``refusal.published`` > 0), tokens after the
        ``computed`` ones (vLLM's prefix cache) are claimed and their load fails on the
        worker, so vLLM ends the request with an error instead of answering the published ids
        as text (which is not an edited cache's answer)."""
        rid = request.request_id
        if self.fail and refusal.published > 0:  # a load that must fail, naming the file and why
            claim = min(max(refusal.published - computed, 1), request.num_tokens - 1 - computed)
            self._matches[rid] = _Match(
                refusal.path,
                refusal.published,
                refusal.digest,
                computed,
                max(claim, 0),
                f"{refusal.reason}: {refusal.detail}",
            )
        else:
            self._matches.pop(rid, None)
        if rid not in self._outcome:  # this may be asked again for the same request
            self.refusals[refusal.reason] += 1
            self._outcome[rid] = {"refused": refusal.reason, "detail": refusal.detail}
            if refusal.digest is not None:
                self._outcome[rid]["digest"] = refusal.digest
            self.logger.warning(
                "kvedit connector: refused %s for request %s (%s: %s); refusals so far: %s",
                refusal.path or self.root,
                rid,
                refusal.reason,
                refusal.detail,
                dict(self.refusals),
            )
        match = self._matches.get(rid)
        return (match.claim if match is not None else 0), False

    def match(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: the prompt tokens a published cache serves."""
        self._matches.pop(request.request_id, None)  # asked again: decide afresh
        ids = list(request.prompt_token_ids or [])
        decision = admit(
            self.index,
            ids,
            getattr(request, "kv_transfer_params", None),
            check=self.check,
            fingerprint=self.fingerprint,
            computed=num_computed_tokens,
        )
        if decision is None:
            return 0, False  # not a published prompt: vLLM computes it
        if isinstance(decision, Refusal):
            return self._refuse(request, decision, num_computed_tokens)
        claim = min(decision.n, request.num_tokens - 1)  # vLLM must compute at least one token
        digest = decision.meta["digest"]
        self._matches[request.request_id] = _Match(str(decision.path), decision.n, digest, 0, claim)
        return claim, False

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """``update_state_after_alloc``: the load (or the failing load) the request gets."""
        rid = request.request_id
        match = self._matches.get(rid)
        if match is None:
            return
        if not match.refused and num_external_tokens == 0 and match.claim > 0:
            # vLLM kept a (sub-block) prefix-cache hit instead of the claim: refuse it too,
            # failing on the request's first block (a cached one)
            match.refused = "prefix-cache: vLLM kept its own prefix-cache blocks for the prompt"
            match.start = 1
            self._late_refusal(rid, match)
            if not self.fail:
                return
        if match.refused:
            self._failing_load(rid, match, num_external_tokens)
            return
        if num_external_tokens <= 0:
            return
        self._pending[rid] = LoadSpec(rid, match.path, 0, num_external_tokens, ())
        if self._outcome.get(rid, {}).get("served") is None:
            self.served += 1
        self._outcome[rid] = {
            "served": num_external_tokens,
            "published": match.published,
            "file": Path(match.path).name,
            "digest": match.digest,
        }

    def _failing_load(self, rid: str, match: _Match, num_external_tokens: int) -> None:
        """The load that fails a refused request on purpose (claimed tokens, else the last
        prefix-cache block), or a warning that it cannot be failed."""
        if num_external_tokens > 0:
            end = match.start + num_external_tokens
            self._pending[rid] = LoadSpec(rid, match.path, match.start, end, (), match.refused)
        elif match.start > 0:  # nothing claimed: fail on the last prefix-cache block
            spec = LoadSpec(rid, match.path, match.start - 1, match.start, (), match.refused)
            self._pending[rid] = spec
        else:
            self.logger.warning(
                "kvedit connector: request %s cannot be failed (nothing of its prompt is "
                "loaded or cached); vLLM computes it: %s",
                rid,
                match.refused,
            )

    def _late_refusal(self, rid: str, match: _Match) -> None:
        """Count and log a refusal decided at allocation."""
        reason = match.refused.split(":", 1)[0]
        self.refusals[reason] += 1
        self._outcome[rid] = {"refused": reason, "detail": match.refused, "digest": match.digest}
        self.logger.warning(
            "kvedit connector: refused %s for request %s (%s); refusals so far: %s",
            match.path,
            rid,
            match.refused,
            dict(self.refusals),
        )

    def metadata(self, scheduler_output: SchedulerOutput) -> KVEditConnectorMetadata:
        """``build_connector_meta``: the loads and saves the workers run next step."""
        meta = KVEditConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._pending:
                spec = self._pending.pop(req.req_id)
                spec.block_ids = req.block_ids
                meta.loads.append(spec)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):  # resumed after preemption: all its blocks
            if rid in self._pending and rid in cached.resumed_req_ids:
                block_ids = cached.new_block_ids[i]
                if block_ids is not None:
                    spec = self._pending.pop(rid)
                    spec.block_ids = block_ids
                    meta.loads.append(spec)
        meta.saves, self._saves = self._saves, []
        return meta

    def finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: whether the blocks wait for a turn's save, and the outcome."""
        rid = request.request_id
        self._matches.pop(rid, None)
        self._pending.pop(rid, None)
        outcome = self._outcome.pop(rid, None)
        turn = requested_turn(getattr(request, "kv_transfer_params", None))
        spec = None
        try:
            spec = saving.save_spec(request, turn, outcome, block_ids) if turn else None
        except KVEditError as e:  # said at once: the server does not wait for it
            try:
                turns.write_turn_error(self.root, turn, str(e))
            except KVEditError as err:
                self.logger.warning(
                    "kvedit connector: turn %s: %s; not recorded (%s)", turn, e, err
                )
        if spec is not None:  # the blocks are freed once the worker reports the save
            self._saves.append(spec)
            outcome = {**(outcome or {"served": 0}), "turn": turn, "saved": len(spec.token_ids)}
        return spec is not None, ({"kvedit": outcome} if outcome is not None else None)
