"""The kvedit connector's loading side (vLLM's workers): a served request's published K/V
written into its slots.

:class:`Loading` answers the workers' load calls of
:class:`~kvedit.integrations.vllm.connector.KVEditConnector` (its module doc says how a load
runs): :meth:`Loading.start` (``start_load_kv``: every load the scheduler sent this step) and
:meth:`Loading.errors` (``get_block_ids_with_load_errors``). It keeps the last published
files read (keyed by their seal's tensor digest) and the blocks whose load failed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.models.utils import extract_layer_index

from ...errors import KVEditError
from . import files, heads
from .connector_scheduling import KVEditConnectorMetadata, LoadSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

__all__ = ["NULL_BLOCK", "Loading"]

NULL_BLOCK = 0
"""vLLM's null block id (a placeholder for blocks a sliding window dropped): never written."""

_FILE_CACHE = 4  # published files kept in memory per worker
_FAILURES = (KVEditError, OSError, ValueError, RuntimeError, KeyError, IndexError, TypeError)


class Loading:
    """The worker side's loads (see the module doc).

    Args:
        vllm_config: the engine's configuration (dtype, tensor parallelism, block size).
        layer_group: each attention layer's KV-cache group.
        root: the publish root (named in logs).
        fail: ``kv_load_failure_policy == "fail"`` (said in logs).
        logger: vLLM's logger for the connector.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        layer_group: dict[str, int],
        root: Path,
        fail: bool,
        logger: logging.Logger,
    ) -> None:
        self.vllm_config, self.layer_group = vllm_config, layer_group
        self.root, self.fail, self.logger = root, fail, logger
        self.block_size = vllm_config.cache_config.block_size
        self._files: OrderedDict[tuple[str, str], tuple[dict, dict]] = OrderedDict()
        self._load_errors: set[int] = set()

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

    def start(self, meta: Any, forward_context: ForwardContext) -> None:
        """``start_load_kv``: run this step's loads; a failed one's blocks are reported."""
        assert isinstance(meta, KVEditConnectorMetadata)
        for load in meta.loads:
            try:
                self._load(forward_context, load)
            except _FAILURES as e:
                self.logger.warning(
                    "kvedit connector: load of %s for request %s failed (%s); vLLM %s",
                    load.path or self.root,
                    load.req_id,
                    e,
                    "ends the request with an error"
                    if self.fail
                    else "computes the prompt itself (kv_load_failure_policy recompute)",
                )
                self._load_errors.update(self._blocks_of(load))

    def errors(self) -> set[int]:
        """``get_block_ids_with_load_errors``: the blocks whose load failed since last asked."""
        out, self._load_errors = self._load_errors, set()
        return out

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
        tp_size = self.vllm_config.parallel_config.tensor_parallel_size
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
            _check_window(i, meta["windows"][i], getattr(impl, "sliding_window", None))
            keys, values = tensors[f"layer.{i}.keys"], tensors[f"layer.{i}.values"]
            try:  # this rank's KV heads (vLLM's rule: split, or replicated when tp > heads)
                keys = heads.slice_for_rank(keys, tp_size, rank, layer.num_kv_heads)
                values = heads.slice_for_rank(values, tp_size, rank, layer.num_kv_heads)
            except KVEditError as e:
                raise ValueError(f"layer {i}: {e}") from e
            blocks = load.block_ids[self.layer_group.get(name, 0)]
            self._write(layer, impl, kv_cache, keys, values, blocks, meta["first_slot"][i], load)

    def _write(self, layer, impl, kv_cache, keys, values, blocks, first: int, load) -> None:
        """Write rows ``[first.., load.end)`` of one layer into its slots (null blocks
        skipped) through the backend's own ``do_kv_cache_update``."""
        start = max(first, 0)
        token = torch.arange(start, load.end)
        block = torch.tensor(blocks, dtype=torch.long)[token // self.block_size]
        keep = block != NULL_BLOCK
        slots = (block * self.block_size + token % self.block_size)[keep]
        rows = (token - first)[keep]
        if rows.numel() == 0:
            return
        device, dtype = kv_cache.device, self.vllm_config.model_config.dtype
        impl.do_kv_cache_update(
            layer,
            keys[rows].to(device, dtype).contiguous(),
            values[rows].to(device, dtype).contiguous(),
            kv_cache,
            slots.to(device),
        )


def _check_window(i: int, window: int | None, engine_window: Any) -> None:
    """Refuse a layer whose published window is not the engine's."""
    engine_window = None if engine_window in (None, -1) else engine_window
    if isinstance(engine_window, tuple):  # (left, right) in some backends
        engine_window = engine_window[0] + 1
    if window != engine_window:
        raise ValueError(f"layer {i}: window {window} published, {engine_window} served")
