"""The kvedit connector's saving side (vLLM's worker): a finished chat turn's K/V read back
from the paged cache and written for the server.

:class:`Saving` answers the worker's save calls of
:class:`~kvedit.integrations.vllm.connector.KVEditConnector`:
:meth:`Saving.register` (``register_kv_caches``), :meth:`Saving.save` (``wait_for_save``:
every turn the scheduler sent this step, gathered by :class:`~kvedit.integrations.vllm.saving.Saver`
and written by :func:`~kvedit.integrations.vllm.turns.write_turn`, or a record of why not) and
:meth:`Saving.finished` (``get_finished``: the requests whose blocks may now be freed).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.models.utils import extract_layer_index

from ...errors import KVEditError
from . import saving, turns
from .connector_scheduling import KVEditConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["Saving"]


class Saving:
    """The worker side's saves (see the module doc)."""

    def __init__(self, vllm_config: VllmConfig, root: Path, logger: logging.Logger) -> None:
        self.vllm_config, self.root, self.logger = vllm_config, root, logger
        self._saver = saving.Saver(vllm_config.cache_config.block_size)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._saved: set[str] = set()  # requests whose save is done (or failed)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def save(self, meta: Any) -> None:
        """Save every turn in ``meta``; one that fails gets a record saying why."""
        if not isinstance(meta, KVEditConnectorMetadata):
            return
        for spec in meta.saves:
            try:
                self._save(spec)
            except (KVEditError, OSError, ValueError, RuntimeError, KeyError, IndexError) as e:
                self.logger.warning("kvedit connector: turn %s not saved (%s)", spec.turn, e)
                try:
                    turns.write_turn_error(self.root, spec.turn, str(e))
                except KVEditError as err:
                    self.logger.warning("kvedit connector: cannot record it either (%s)", err)
            self._saved.add(spec.req_id)  # its blocks may be freed either way

    def _save(self, spec: saving.SaveSpec) -> None:
        """Gather the turn's K/V from every layer and write them (:mod:`.saving`)."""
        parallel = self.vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise KVEditError("chat memories are saved from one worker only (no TP/PP)")
        context = self.vllm_config.compilation_config.static_forward_context
        keys, values = self._saver.gather(
            self._kv_caches,
            context,
            extract_layer_index,
            spec.block_ids,
            spec.start,
            spec.start + len(spec.token_ids),
        )
        turns.write_turn(self.root, spec.turn, spec.start, spec.token_ids, keys, values)

    def finished(self) -> set[str] | None:
        """The requests whose save is done (their blocks may be freed), since last asked."""
        done, self._saved = self._saved, set()
        return done or None
