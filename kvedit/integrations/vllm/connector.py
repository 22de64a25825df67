"""The vLLM KV connector that serves published kvedit caches (needs ``vllm``; pinned 0.32).

vLLM loads it by name (:func:`kvedit.integrations.vllm.engine` configures it)::

    KVTransferConfig(kv_connector="KVEditConnector",
                     kv_connector_module_path="kvedit.integrations.vllm.connector",
                     kv_role="kv_consumer", kv_connector_extra_config={"root": ROOT})

**Scheduler side.** For a new request, :meth:`KVEditConnector.get_num_new_matched_tokens`
finds the published cache to serve it from (:class:`~kvedit.integrations.vllm.files.PublishedIndex`):
the one whose digest the request names (``kv_transfer_params={"kvedit": {"digest": D}}``;
offline ``SamplingParams(extra_args={"kv_transfer_params": ...})``) and whose ids start the
prompt, or, when it names none, a plain capture published for the longest published prefix of
the prompt. It checks the file's header against the engine (layers, KV heads, head size, and
the kvedit model fingerprint when the engine was given one) and claims all its tokens, a
partial last block included, so vLLM never computes them. What it cannot serve it refuses
(the reasons: :mod:`~kvedit.integrations.vllm.admission`, the decision ``kvedit serve``'s
request check shares), a log line with the running count per reason
(:attr:`KVEditConnector.refusals`).

With ``kv_load_failure_policy="fail"`` (the default of ``engine`` and ``kvedit serve``) a
refused request that asked for a published cache fails closed: tokens after vLLM's own
computed ones are claimed and their load fails on the worker, which reports only those
tokens' blocks (the request's own, so no other request is hit), and vLLM ends the request
with an error. Should vLLM's prefix cache cover all but the last prompt token, the last cached
block is reported instead (it is evicted; another running request sharing it fails too: keep
prefix caching off). With ``"recompute"`` vLLM computes a refused prompt as usual. Each
finished request's ``RequestOutput.kv_transfer_params["kvedit"]`` says what happened to it
(``{"served": n, "published": n, "file": ..., "digest": ...}`` or ``{"refused": reason,
"detail": ..., "digest": ...}``); vLLM 0.32 returns none for a request that ended with an error.

**Worker side.** :meth:`KVEditConnector.start_load_kv` reads the file (its seal verified:
the digests of its header and tensors, :mod:`kvedit.states.files.seal`), and writes
each layer's rows ``[tokens, kv_heads, head_dim]`` into the request's slots through the
attention backend's own ``do_kv_cache_update`` (so the code is independent of the cache
layout, which differs by backend and instruction set), per KV-cache group (sliding-window
layers have their own block table; slots in the null block are skipped), KV heads sliced to
this worker's tensor-parallel rank by vLLM's own rule (:mod:`~kvedit.integrations.vllm.heads`:
split evenly, or one replicated head per rank when the ranks outnumber the KV heads). Under
pipeline parallelism each stage's worker sees only its own attention layers (named by their
global index) and loads those. A load that fails (file gone, corrupted, shapes off) reports
its blocks through :meth:`get_block_ids_with_load_errors`: with
``kv_load_failure_policy="fail"`` (``engine``'s and ``kvedit serve``'s default) vLLM ends the
request with ``finish_reason == "error"``; with ``"recompute"`` it computes the blocks itself
(the state's answer only for an unedited state). The scheduler's outcome
(``kv_transfer_params["kvedit"]``) is decided before the load, so it still says "served".

**Saving a chat turn.** A request carrying ``{"kvedit": {"turn": T}}`` (``kvedit serve``'s chat
memories set it, :mod:`~kvedit.integrations.vllm.chat`) that ends (EOS, a stop, ``max_tokens``,
or aborted: vLLM's front end aborts a request that met a stop string) keeps its blocks
(``request_finished`` returns True; one that failed gets a record saying so at once); the next step's :meth:`~KVEditConnector.wait_for_save`
reads the tokens vLLM computed back from the paged cache (:mod:`~kvedit.integrations.vllm.saving`:
the layout probed through the backend's own writer) and writes them for the server
(:mod:`~kvedit.integrations.vllm.turns`); ``get_finished`` then lets vLLM free the blocks.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...errors import KVEditError
from . import files, heads, saving, turns
from .admission import Refusal, admit, requested_turn

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger: logging.Logger = init_logger(__name__)

NULL_BLOCK = 0
"""vLLM's null block id (a placeholder for blocks a sliding window dropped): never written."""

_FILE_CACHE = 4  # published files kept in memory per worker


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


class KVEditConnector(KVConnectorBase_V1):
    """Serves prompts that start with a published kvedit cache (see the module doc)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("root"):
            raise KVEditError(
                "KVEditConnector needs kv_connector_extra_config['root'], the folder "
                "kvedit.integrations.vllm.publish writes to"
            )
        self.root = Path(extra["root"])
        self.model_fingerprint: str | None = extra.get("model_fingerprint")
        self.block_size = vllm_config.cache_config.block_size
        self._fail = self._kv_transfer_config.kv_load_failure_policy == "fail"
        self.index = files.PublishedIndex(self.root)
        self.refusals: Counter[str] = Counter()
        """Refused requests per reason (scheduler side)."""
        self.served = 0
        """Requests served from a published cache (scheduler side)."""
        self._matches: dict[str, _Match] = {}
        self._outcome: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, LoadSpec] = {}
        self._load_errors: set[int] = set()
        self._saves: list[saving.SaveSpec] = []  # scheduler: finished turns for the next step
        self._saved: set[str] = set()  # worker: requests whose save is done (or failed)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._saver = saving.Saver(self.block_size)
        self._files: OrderedDict[tuple[str, str], tuple[dict, dict]] = OrderedDict()
        self._layer_group: dict[str, int] = {
            name: g
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        if vllm_config.cache_config.enable_prefix_caching and role == KVConnectorRole.SCHEDULER:
            logger.warning(
                "kvedit connector: automatic prefix caching is on; a prompt that starts with "
                "published ids and hits vLLM's prefix cache is refused (%s). Pass "
                "enable_prefix_caching=False.",
                "the request ends with an error" if self._fail else "vLLM computes it",
            )

    # ------------------------------------------------------------------ scheduler side

    def _refuse(self, request: Request, refusal: Refusal, computed: int = 0) -> tuple[int, bool]:
        """Refuse to serve ``request``. With ``kv_load_failure_policy="fail"`` and a request
        that asked for a published cache (``refusal.published`` > 0), tokens after the
        ``computed`` ones (vLLM's prefix cache) are claimed and their load fails on the
        worker, so vLLM ends the request with an error instead of answering the published ids
        as text (which is not an edited cache's answer)."""
        rid = request.request_id
        if self._fail and refusal.published > 0:  # a load that must fail, naming the file and why
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
            logger.warning(
                "kvedit connector: refused %s for request %s (%s: %s); refusals so far: %s",
                refusal.path or self.root,
                rid,
                refusal.reason,
                refusal.detail,
                dict(self.refusals),
            )
        match = self._matches.get(rid)
        return (match.claim if match is not None else 0), False

    def _check(self, meta: dict) -> str | None:
        """Why this engine's model cannot hold a published file (its shapes), or None."""
        mc = self._vllm_config.model_config
        # All the model's layers: under pipeline parallelism get_num_layers(parallel_config)
        # counts one stage's only; each stage's worker loads its own layers from the file.
        want = {
            "n_layers": mc.get_total_num_hidden_layers(),
            "kv_heads": mc.get_total_num_kv_heads(),
            "head_dim": mc.get_head_size(),
        }
        for key, value in want.items():
            if meta.get(key) != value:
                return f"{key} {meta.get(key)} in the file, {value} in the engine's model"
        return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._matches.pop(request.request_id, None)  # asked again: decide afresh
        ids = list(request.prompt_token_ids or [])
        decision = admit(
            self.index,
            ids,
            getattr(request, "kv_transfer_params", None),
            check=self._check,
            fingerprint=self.model_fingerprint,
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

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
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
            if not self._fail:
                return
        if match.refused:
            if num_external_tokens > 0:
                end = match.start + num_external_tokens
                self._pending[rid] = LoadSpec(rid, match.path, match.start, end, (), match.refused)
            elif match.start > 0:  # nothing claimed: fail on the last prefix-cache block
                spec = LoadSpec(rid, match.path, match.start - 1, match.start, (), match.refused)
                self._pending[rid] = spec
            else:
                logger.warning(
                    "kvedit connector: request %s cannot be failed (nothing of its prompt is "
                    "loaded or cached); vLLM computes it: %s",
                    rid,
                    match.refused,
                )
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

    def _late_refusal(self, rid: str, match: _Match) -> None:
        """Count and log a refusal decided at allocation."""
        reason = match.refused.split(":", 1)[0]
        self.refusals[reason] += 1
        self._outcome[rid] = {"refused": reason, "detail": match.refused, "digest": match.digest}
        logger.warning(
            "kvedit connector: refused %s for request %s (%s); refusals so far: %s",
            match.path,
            rid,
            match.refused,
            dict(self.refusals),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
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

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
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
                logger.warning("kvedit connector: turn %s: %s; not recorded (%s)", turn, e, err)
        if spec is not None:  # the blocks are freed once the worker reports the save
            self._saves.append(spec)
            outcome = {**(outcome or {"served": 0}), "turn": turn, "saved": len(spec.token_ids)}
        return spec is not None, ({"kvedit": outcome} if outcome is not None else None)

    # ------------------------------------------------------------------ worker side

    def _read(self, path: str, refused: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
        if refused or not path:
            raise ValueError(f"the scheduler refused it: {refused or 'no file'}")
        # Keyed by the file's own checksum: a file republished under the same name may reuse
        # the old one's inode and modification time.
        key = (path, str(files.read_header(path)["seal"]["tensors"]))
        if key in self._files:
            self._files.move_to_end(key)
            return self._files[key]
        got = files.read(path)
        self._files[key] = got
        while len(self._files) > _FILE_CACHE:
            self._files.popitem(last=False)
        return got

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVEditConnectorMetadata)
        for load in meta.loads:
            try:
                self._load(forward_context, load)
            except (
                KVEditError,
                OSError,
                ValueError,
                RuntimeError,
                KeyError,
                IndexError,
                TypeError,
            ) as e:
                logger.warning(
                    "kvedit connector: load of %s for request %s failed (%s); vLLM %s",
                    load.path or self.root,
                    load.req_id,
                    e,
                    "ends the request with an error"
                    if self._fail
                    else "computes the prompt itself (kv_load_failure_policy recompute)",
                )
                self._load_errors.update(self._blocks_of(load))

    def _blocks_of(self, load: LoadSpec) -> set[int]:
        """The blocks holding the load's tokens ``[start, end)``: reported as failed, so vLLM
        fails (or recomputes) this request and no other that shares a block before them."""
        out: set[int] = set()
        first, last = load.start // self.block_size, (load.end - 1) // self.block_size
        for ids in load.block_ids:
            out.update(b for b in ids[first : last + 1] if b != NULL_BLOCK)
        return out

    def _load(self, forward_context: ForwardContext, load: LoadSpec) -> None:
        meta, tensors = self._read(load.path, load.refused)
        model_dtype = self._vllm_config.model_config.dtype
        tp_size = self._vllm_config.parallel_config.tensor_parallel_size
        rank = 0
        if tp_size > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        for name, layer in forward_context.no_compile_layers.items():
            kv_cache = getattr(layer, "kv_cache", None)
            impl = getattr(layer, "impl", None)
            if not isinstance(kv_cache, torch.Tensor) or impl is None or kv_cache.numel() == 0:
                continue
            i = extract_layer_index(name)
            window = meta["windows"][i]
            engine_window = getattr(impl, "sliding_window", None)
            engine_window = None if engine_window in (None, -1) else engine_window
            if isinstance(engine_window, tuple):  # (left, right) in some backends
                engine_window = engine_window[0] + 1
            if window != engine_window:
                raise ValueError(f"layer {i}: window {window} published, {engine_window} served")
            first = meta["first_slot"][i]
            keys, values = tensors[f"layer.{i}.keys"], tensors[f"layer.{i}.values"]
            try:  # this rank's KV heads (vLLM's rule: split, or replicated when tp > heads)
                keys = heads.slice_for_rank(keys, tp_size, rank, layer.num_kv_heads)
                values = heads.slice_for_rank(values, tp_size, rank, layer.num_kv_heads)
            except KVEditError as e:
                raise ValueError(f"layer {i}: {e}") from e
            blocks = load.block_ids[self._layer_group.get(name, 0)]
            start = max(first, 0)
            token = torch.arange(start, load.end)
            block = torch.tensor(blocks, dtype=torch.long)[token // self.block_size]
            keep = block != NULL_BLOCK
            slots = (block * self.block_size + token % self.block_size)[keep]
            rows = (token - first)[keep]
            if rows.numel() == 0:
                continue
            device = kv_cache.device
            impl.do_kv_cache_update(
                layer,
                keys[rows].to(device, model_dtype).contiguous(),
                values[rows].to(device, model_dtype).contiguous(),
                kv_cache,
                slots.to(device),
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # turns are saved whole once finished (wait_for_save), not layer by layer

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVEditConnectorMetadata):
            return
        for spec in meta.saves:
            try:
                self._save(spec)
            except (KVEditError, OSError, ValueError, RuntimeError, KeyError, IndexError) as e:
                logger.warning("kvedit connector: turn %s not saved (%s)", spec.turn, e)
                try:
                    turns.write_turn_error(self.root, spec.turn, str(e))
                except KVEditError as err:
                    logger.warning("kvedit connector: cannot record it either (%s)", err)
            self._saved.add(spec.req_id)  # its blocks may be freed either way

    def _save(self, spec: saving.SaveSpec) -> None:
        """Gather the turn's K/V from every layer and write them (:mod:`.saving`)."""
        parallel = self._vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise KVEditError("chat memories are saved from one worker only (no TP/PP)")
        context = self._vllm_config.compilation_config.static_forward_context
        keys, values = self._saver.gather(
            self._kv_caches,
            context,
            extract_layer_index,
            spec.block_ids,
            spec.start,
            spec.start + len(spec.token_ids),
        )
        turns.write_turn(self.root, spec.turn, spec.start, spec.token_ids, keys, values)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._saved = self._saved, set()
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out
