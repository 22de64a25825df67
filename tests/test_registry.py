"""kvedit.registry.Registry, the one registry every kvedit registry is (#58), and the proof that
a scorer is one file: a scorer defined and registered here, in a test module, is taken by
``Memory(forget=)``, ``kvedit.compress.select`` and ``kvedit eval memory --methods`` with no
list of names anywhere to extend."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

import kvedit
from kvedit.cache import LAYER_CLASSES
from kvedit.cli.main import main as cli_main
from kvedit.compress import SCORERS, Scorer, register_scorer
from kvedit.errors import CorruptCacheError, InvalidInputError, UnknownModelError
from kvedit.evals.methods import METHODS
from kvedit.evals.metrics import METRICS
from kvedit.evals.tasks import TASKS
from kvedit.memory.forgetting import global_entries
from kvedit.memory.rendering import RENDERERS
from kvedit.models import MODELS
from kvedit.registry import Registry
from kvedit.reusing.blend_rules import BLEND_RULES

# ------------------------------------------------------------------------------ the registry


def first() -> str:
    return "first"


def second() -> str:
    return "second"


def test_register_lookup_iterate_and_remove():
    things: Registry = Registry("gadget")
    assert things.register("b", first) is first
    assert things.decorator("a")(second) is second
    assert list(things) == ["b", "a"]  # registration order
    assert things.names() == ("a", "b")  # sorted
    assert dict(things.items()) == {"b": first, "a": second}
    assert "a" in things and "c" not in things and ["a"] not in things and len(things) == 2
    assert things.lookup("a") is second and things["b"] is first
    with pytest.raises(KeyError):  # item access stays a mapping's
        things["c"]
    del things["a"]
    assert things.names() == ("b",)


def test_the_same_thing_again_is_allowed_another_one_is_refused():
    things: Registry = Registry("gadget")
    things.register("f", first)
    assert things.register("f", first) is first
    with pytest.raises(InvalidInputError, match="gadget 'f' is already registered"):
        things.register("f", second)
    assert things["f"] is first
    assert things.register("f", second, replace=True) is second
    things["f"] = first  # item assignment sets on purpose (what monkeypatch.setitem does)
    assert things["f"] is first
    for bad in ("", None, 3):
        with pytest.raises(InvalidInputError, match="bad gadget name"):
            things.register(bad, first)


def test_an_unknown_name_is_the_registrys_own_error_listing_the_names():
    things: Registry = Registry("gadget")
    with pytest.raises(InvalidInputError, match="unknown gadget 'x'; known: none"):
        things.lookup("x")
    things.register("b", first)
    things.register("a", second)
    with pytest.raises(InvalidInputError, match="unknown gadget 'x'; known: a, b"):
        things.lookup("x")
    with pytest.raises(InvalidInputError, match=r"unknown gadget \['x'\]"):
        things.lookup(["x"])  # not a name at all: the same error, no TypeError
    kinds: Registry = Registry("cache layer kind", error=CorruptCacheError)
    with pytest.raises(CorruptCacheError, match="unknown cache layer kind 'bogus'"):
        kinds.lookup("bogus")


def test_every_registry_is_one():
    """The eight registries are Registry objects under their old names, each raising its own
    error for an unknown name."""
    registries = [SCORERS, LAYER_CLASSES, RENDERERS, BLEND_RULES, METHODS, TASKS, METRICS, MODELS]
    assert all(isinstance(r, Registry) for r in registries)
    with pytest.raises(CorruptCacheError):
        LAYER_CLASSES.lookup("bogus")
    with pytest.raises(UnknownModelError):
        MODELS.lookup("bogus")
    assert {"dense", "headwise"} <= set(LAYER_CLASSES) and list(BLEND_RULES) == [
        "gradual",
        "leading",
        "rescale",
    ]


# ------------------------------------------------------------------ a scorer in one file

NAME = "test_registry_oldest"
CALLS: list[str] = []  # what each scoring saw: proof the scorer ran, not a built-in one


@dataclass(frozen=True)
class Oldest(Scorer):
    """The oldest entries first (no built-in scorer keeps these): ``-token`` per entry."""

    reads_model = False  # it scores from the cache alone, so a server may forget with it

    def score(self, state, layers):
        CALLS.append(state.text[-20:])
        out = {}
        for i in layers:
            layer = state.layers[i]
            b, heads, n, _ = layer.kv_shape
            order = -layer.token_index.to(torch.float32)
            out[i] = order.to(layer.keys.device).expand(b, heads, n).clone()
        return out


@pytest.fixture
def oldest():
    """``Oldest`` registered as :data:`NAME` for the test, and gone after it."""
    assert NAME not in SCORERS
    CALLS.clear()
    register_scorer(NAME)(Oldest)
    yield NAME
    del SCORERS[NAME]


CHAT = [
    ("user", "My locker code is 4821 and my badge is 77."),
    ("assistant", "Noted."),
    ("user", "The weather is nice today, the river is calm near the old bridge."),
    ("assistant", "It is sunny."),
]


def test_a_scorer_registered_here_is_a_forgetting_policy(llama, oldest):
    model, tok = llama
    mem = kvedit.Memory(model, tok, max_tokens=120, forget=oldest)
    for _ in range(4):
        for role, content in CHAT:
            mem.add(role, content)
    assert mem.forgetting and {r.policy for r in mem.forgetting} == {oldest}
    assert CALLS and global_entries(mem.state) <= 120 < len(mem.state)
    held = set(mem.state.layers[mem.state.global_layers[0]].token_index.tolist())
    dropped = set(range(len(mem.state))) - held
    assert min(dropped) > 40  # the oldest tokens kept (a built-in policy drops them first)


def test_a_scorer_registered_here_is_taken_by_select(llama, oldest):
    model, tok = llama
    state = kvedit.capture(model, tok, " ".join(content for _, content in CHAT))
    out = kvedit.compress.select(state, oldest, 0.5)
    assert CALLS
    for i in state.global_layers:
        kept = out.layers[i].token_index.tolist()
        assert kept[:-1] == list(range(len(kept) - 1))  # the oldest (and the last token)
        assert len(state) // 2 - 1 <= len(kept) < len(state)
    assert "Oldest" in out.history.steps[-1].params["scorer"]


def test_a_scorer_registered_here_is_an_eval_memory_method(tmp_path, oldest, capsys):
    assert cli_main(["eval", "memory", "--help"]) == 0
    assert oldest in capsys.readouterr().out  # the help's list comes from the registry
    out = tmp_path / "run"
    args = ["eval", "memory", "--model", "tiny-llama", "--task", "facts", "--size", "40"]
    args += ["--questions", "3", "--n-examples", "1", "--max-new-tokens", "2", "--no-progress"]
    args += ["--methods", f"reuse,{oldest}", "--budgets", "0.5", "--out", str(out)]
    assert cli_main(args) == 0
    data = json.loads((out / "results.json").read_text())
    assert set(data["methods"]) == {"reuse", oldest}
    forgot = [r for r in data["examples"] if r["method"] == oldest]
    assert forgot and all(r["rounds"] >= 1 for r in forgot)
    assert CALLS


def test_a_scorer_registered_here_serves_by_its_trait(oldest, capsys):
    from kvedit.integrations.vllm.conversations import servable_policies, served_policy

    assert oldest in servable_policies() and served_policy(oldest) == oldest
    assert cli_main(["serve", "--help"]) == 0
    assert oldest in capsys.readouterr().out  # --forget's help comes from the registry
    SCORERS[oldest].reads_model = True  # the same scorer, were it to run the model
    try:
        with pytest.raises(InvalidInputError, match="cannot serve"):
            served_policy(oldest)
    finally:
        SCORERS[oldest].reads_model = False


def test_a_scorer_name_taken_is_refused():
    with pytest.raises(InvalidInputError, match="scorer 'knorm' is already registered"):
        register_scorer("knorm")(Oldest)
    assert SCORERS["knorm"].__name__ == "KNorm"
    with pytest.raises(InvalidInputError, match="unknown scorer 'nope'; known: h2o, knorm"):
        kvedit.compress.make_scorer("nope")


# ------------------------------------------------------- a scorer says whether it reads the model


def test_reads_model_is_said_truthfully_by_every_scorer(llama, learned_fit, monkeypatch):
    """``reads_model`` (#66): a scorer that says False scores with the model unable to run; one
    that says True fails there. The safe side is the default: a new scorer reads the model
    unless it says otherwise."""
    model, tok = llama
    learned_fit(model, tok)
    state = kvedit.capture(model, tok, "The river is calm near the old bridge. " * 3)
    layers = state.counted_layers

    def no_pass(*args, **kwargs):
        raise RuntimeError("the model ran")

    monkeypatch.setattr(model, "forward", no_pass)
    assert Scorer.reads_model is True
    assert {n for n, cls in SCORERS.items() if not cls.reads_model} >= {"learned", "knorm"}
    for name, cls in SCORERS.items():
        if name == NAME:
            continue
        if cls.reads_model:
            with pytest.raises(RuntimeError, match="the model ran"):
                cls().score(state, layers)
        else:
            scores = cls().score(state, layers)
            assert set(scores) == set(layers), name
    from kvedit.compress import AdaKV

    assert AdaKV(SCORERS["knorm"]()).reads_model is False
    assert AdaKV(SCORERS["kvzip"]()).reads_model is True
