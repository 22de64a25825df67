"""The vLLM KV connector that serves published kvedit caches (needs ``vllm``; pinned 0.32).

How it serves, and why, is in ``docs/vllm.md``. The class composes three sides, one module
each, that run in different processes and share no state (what the scheduler decided reaches
the workers in :class:`~kvedit.integrations.vllm.connector_scheduling.KVEditConnectorMetadata`):

=============================== ==============================================================
vLLM calls                      answered by
=============================== ==============================================================
``get_num_new_matched_tokens``  :mod:`~kvedit.integrations.vllm.connector_scheduling`
``update_state_after_alloc``    (scheduler process: ``Scheduling.match``, ``allocated``,
``build_connector_meta``        ``metadata``, ``finished``)
``request_finished``
``start_load_kv``               :mod:`~kvedit.integrations.vllm.connector_loading`
``wait_for_layer_load``         (workers: ``Loading.start``, ``errors``; nothing to wait for)
``get_block_ids_with_load_errors``
``register_kv_caches``          :mod:`~kvedit.integrations.vllm.connector_saving`
``save_kv_layer``               (worker: ``Saving.register``, ``save``, ``finished``; nothing is
``wait_for_save``               saved layer by layer)
``get_finished``
=============================== ==============================================================

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
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...errors import KVEditError
from .connector_loading import NULL_BLOCK, Loading
from .connector_saving import Saving
from .connector_scheduling import KVEditConnectorMetadata, LoadSpec, Scheduling

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["NULL_BLOCK", "KVEditConnector", "KVEditConnectorMetadata", "LoadSpec"]

logger: logging.Logger = init_logger(__name__)


class KVEditConnector(KVConnectorBase_V1):
    """Serves prompts that start with published kvedit caches (see the module doc)."""

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
        fail = self._kv_transfer_config.kv_load_failure_policy == "fail"
        self.scheduling = Scheduling(self.root, self.model_fingerprint, fail, self._check, logger)
        layer_group = {
            name: g
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.loading = Loading(vllm_config, layer_group, self.root, fail, logger)
        self.saving = Saving(vllm_config, self.root, logger)
        if vllm_config.cache_config.enable_prefix_caching and role == KVConnectorRole.SCHEDULER:
            logger.warning(
                "kvedit connector: automatic prefix caching is on; a prompt that starts with "
                "published ids and hits vLLM's prefix cache is refused (%s). Pass "
                "enable_prefix_caching=False.",
                "the request ends with an error" if fail else "vLLM computes it",
            )

    @property
    def refusals(self) -> Counter[str]:
        """Refused requests per reason (scheduler side)."""
        return self.scheduling.refusals

    @property
    def served(self) -> int:
        """Requests served from a published cache (scheduler side)."""
        return self.scheduling.served

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

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduling.match(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduling.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduling.metadata(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduling.finished(request, block_ids)

    # ------------------------------------------------------------------ worker side: loading

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.loading.start(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loading.errors()

    # ------------------------------------------------------------------ worker side: saving

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.saving.register(kv_caches)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # turns are saved whole once finished (wait_for_save), not layer by layer

    def wait_for_save(self) -> None:
        self.saving.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.saving.finished(), None
