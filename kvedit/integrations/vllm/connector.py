"""The vLLM KV connector that serves published kvedit caches (needs ``vllm``; pinned 0.32).

vLLM loads it by name (:func:`kvedit.integrations.vllm.engine` configures it)::

    KVTransferConfig(kv_connector="KVEditConnector",
                     kv_connector_module_path="kvedit.integrations.vllm.connector",
                     kv_role="kv_consumer", kv_connector_extra_config={"root": ROOT})

**Scheduler side.** For a new request, :meth:`KVEditConnector.get_num_new_matched_tokens`
finds the longest published cache whose token ids start the prompt
(:class:`~kvedit.integrations.vllm.files.PublishedIndex`), checks its header against the engine
(layers, KV heads, head size, and the kvedit model fingerprint when the engine was given one),
and claims all its tokens, a partial last block included, so vLLM never computes them; only
when the prompt is exactly the published ids does it claim one fewer (vLLM must run at least
one token). What it cannot serve it refuses: a log line with the running count per reason
(:attr:`KVEditConnector.refusals`); with ``kv_load_failure_policy="fail"`` (the default of
``engine`` and ``kvedit serve``) a refused file's tokens are still claimed and their load
fails, so the request ends with an error; with ``"recompute"`` vLLM computes the prompt as
usual. Each finished
request's ``RequestOutput.kv_transfer_params["kvedit"]`` says what happened to it
(``{"served": n, "file": ...}`` or ``{"refused": reason}``).

**Worker side.** :meth:`KVEditConnector.start_load_kv` reads the file (CRC verified), and writes
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
from . import files, heads

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
    """One request's load: ``tokens`` prompt tokens from ``path`` into ``block_ids`` (one list
    per KV-cache group)."""

    req_id: str
    path: str
    tokens: int
    block_ids: tuple[list[int], ...]


@dataclass
class KVEditConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


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
        self._matches: dict[str, tuple[str, int]] = {}  # req_id -> (path, published tokens)
        self._outcome: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, tuple[str, int]] = {}
        self._load_errors: set[int] = set()
        self._files: OrderedDict[tuple[str, str], tuple[dict, dict]] = OrderedDict()
        self._layer_group: dict[str, int] = {
            name: g
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        if vllm_config.cache_config.enable_prefix_caching and role == KVConnectorRole.SCHEDULER:
            logger.warning(
                "kvedit connector: automatic prefix caching is on; two published caches that "
                "share leading token ids (or a plain prompt with those ids) would reuse each "
                "other's blocks. Pass enable_prefix_caching=False."
            )

    # ------------------------------------------------------------------ scheduler side

    def _refuse(
        self, request: Request, reason: str, detail: str, published: int = 0
    ) -> tuple[int, bool]:
        """Refuse to serve ``request``. With ``kv_load_failure_policy="fail"`` and a matched
        file of ``published`` tokens, the tokens are still claimed and their load fails on
        the worker, so vLLM ends the request with an error instead of answering the published
        ids as text (which is not the published cache's answer when it was edited)."""
        rid = request.request_id
        if self._fail and published > 0:
            self._matches[rid] = ("", published)  # "": a load that must fail
        if rid not in self._outcome:  # this may be asked again for the same request
            self.refusals[reason] += 1
            self._outcome[rid] = {"refused": reason, "detail": detail}
            logger.warning(
                "kvedit connector: refused request %s (%s: %s); refusals so far: %s",
                rid,
                reason,
                detail,
                dict(self.refusals),
            )
        if rid in self._matches:
            return min(published, request.num_tokens - 1), False
        return 0, False

    def _check(self, meta: dict) -> str | None:
        """Why this engine cannot serve a published file, or None."""
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
        fp = meta.get("model_fingerprint")
        if self.model_fingerprint and fp and fp != self.model_fingerprint:
            return f"made by model {fp}, the engine runs {self.model_fingerprint}"
        return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        ids = list(request.prompt_token_ids or [])
        try:
            found = self.index.lookup(ids)
        except OSError as e:
            return self._refuse(request, "root", f"cannot list {self.root}: {e}")
        if found is None:
            return 0, False
        path, n = found
        try:
            meta = files.read_header(path)
        except (KVEditError, OSError) as e:
            return self._refuse(request, "corrupt", str(e), n)
        if meta.get("token_ids") != ids[:n]:
            detail = f"{path.name}: token ids differ from its name"
            return self._refuse(request, "corrupt", detail, n)
        why = self._check(meta)
        if why is not None:
            return self._refuse(request, "mismatch", f"{path.name}: {why}", n)
        claim = min(n, request.num_tokens - 1)  # vLLM must compute at least one token
        if num_computed_tokens > 0:
            return self._refuse(
                request,
                "prefix-cache",
                f"{num_computed_tokens} tokens already hit vLLM's prefix cache; a stale block "
                "may hold another cache's entries (turn prefix caching off)",
            )
        self._matches[request.request_id] = (str(path), n)
        return claim, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if num_external_tokens > 0 and rid in self._matches:
            path, n = self._matches[rid]
            self._pending[rid] = (path, num_external_tokens)
            if not path:  # refused: the load fails on the worker (see _refuse)
                return
            if rid not in self._outcome:
                self.served += 1
            self._outcome[rid] = {
                "served": num_external_tokens,
                "published": n,
                "file": Path(path).name,
            }

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVEditConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._pending:
                path, tokens = self._pending.pop(req.req_id)
                meta.loads.append(LoadSpec(req.req_id, path, tokens, req.block_ids))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):  # resumed after preemption: all its blocks
            if rid in self._pending and rid in cached.resumed_req_ids:
                block_ids = cached.new_block_ids[i]
                if block_ids is not None:
                    path, tokens = self._pending.pop(rid)
                    meta.loads.append(LoadSpec(rid, path, tokens, block_ids))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._matches.pop(rid, None)
        self._pending.pop(rid, None)
        outcome = self._outcome.pop(rid, None)
        return False, ({"kvedit": outcome} if outcome is not None else None)

    # ------------------------------------------------------------------ worker side

    def _read(self, path: str) -> tuple[dict, dict[str, torch.Tensor]]:
        if not path:
            raise ValueError("the scheduler refused this published cache (see its log line)")
        # Keyed by the file's own checksum: a file republished under the same name may reuse
        # the old one's inode and modification time.
        key = (path, str(files.read_header(path).get("checksum")))
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
                    "kvedit connector: load of %s for request %s failed (%s); vLLM fails the request "
                    "or recomputes it (kv_load_failure_policy)",
                    load.path,
                    load.req_id,
                    e,
                )
                for ids in load.block_ids:
                    self._load_errors.update(b for b in ids if b != NULL_BLOCK)

    def _load(self, forward_context: ForwardContext, load: LoadSpec) -> None:
        meta, tensors = self._read(load.path)
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
            token = torch.arange(start, load.tokens)
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
        return

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out
