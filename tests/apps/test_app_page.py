"""The highlight page stays true (#69): panels of an old request are emptied when its inputs
change, the status sits beside Run, one-click examples fill a valid request, the difference
view shows after minus before, and the ``/focus`` example of docs/app.md picks a passage."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("gradio")  # the app's extra

from apps import highlight  # noqa: E402
from apps.highlight import Highlighter  # noqa: E402
from apps.highlight.samples import EXAMPLES  # noqa: E402

RESULTS = ["baseline", "steered", "before", "after", "diff", "cache"]
PICKS = ["focus-scores", "focus-passages"]


@pytest.fixture(scope="module")
def app(llama):
    model, tok = llama
    return Highlighter(model, tok, "tiny-llama", focus_threshold=None)


@pytest.fixture(scope="module")
def demo(app):
    return highlight.build_app(app)


def _elem_ids(demo) -> dict[int, str | None]:
    return {c["id"]: c["props"].get("elem_id") for c in demo.config["components"]}


def events(demo, elem_id: str, trigger: str) -> list:
    """The functions that ``trigger`` on the component ``elem_id`` runs."""
    ids = _elem_ids(demo)
    return [
        f
        for f in demo.fns.values()
        if any(ids.get(target) == elem_id and kind == trigger for target, kind in f.targets)
    ]


def _cleared(fn, *args) -> dict[str, object]:
    values = fn.fn(*args)
    return {o.elem_id: v for o, v in zip(fn.outputs, values, strict=True)}


def test_typing_a_context_empties_the_old_requests_panels(demo):
    (fn,) = events(demo, "context", "input")
    out = _cleared(fn)
    assert set(out) == {"hint", *PICKS, *RESULTS, "status"}
    assert all(v in ("", None) for v in out.values()), out


@pytest.mark.parametrize("box", ["emphasize", "suppress", "question"])
def test_typing_spans_or_a_question_empties_picks_and_results_but_keeps_the_hint(demo, box):
    (fn,) = events(demo, box, "input")
    out = _cleared(fn)
    assert set(out) == {*PICKS, *RESULTS, "status"}  # the sample's hint still holds
    assert all(v in ("", None) for v in out.values()), out


def test_loading_a_sample_empties_the_previous_requests_panels(demo):
    (fn,) = events(demo, "load-sample", "click")
    out = _cleared(fn, 0)
    assert {*PICKS, *RESULTS, "status"} <= set(out)
    assert all(out[k] in ("", None) for k in (*PICKS, *RESULTS, "status"))
    assert out["hint"].startswith("**Sample**")


def test_a_span_added_from_the_selection_empties_the_old_panels(demo):
    ids = _elem_ids(demo)
    (button,) = [
        c["id"]
        for c in demo.config["components"]
        if c["props"].get("value") == ("Emphasize selection")
    ]
    fns = [f for f in demo.fns.values() if any(t == (button, "click") for t in f.targets)]
    (js,) = fns
    assert js.fn is None and "selectionStart" in js.js  # the span is read in the browser
    (then,) = [f for f in demo.fns.values() if f.trigger_after == js._id]
    assert {o.elem_id for o in then.outputs} == {*PICKS, *RESULTS}
    assert all(v in ("", None) for v in then.fn(""))
    import gradio as gr

    kept = then.fn("**Not added:** select some text in the context first")
    assert all(isinstance(v, type(gr.skip())) for v in kept)  # nothing added, nothing stale
    assert ids  # (the components are in the config)


def _parents(layout: dict, path: tuple = ()) -> dict[int, tuple]:
    out = {layout["id"]: path}
    for child in layout.get("children", []):
        out |= _parents(child, (*path, layout["id"]))
    return out


def test_the_status_sits_beside_run_above_the_answers(demo):
    by_elem = {v: k for k, v in _elem_ids(demo).items() if v}
    parents = _parents(demo.config["layout"])
    run, status = parents[by_elem["run"]], parents[by_elem["status"]]
    # The same column holds Run (in its row of buttons) and the status line.
    assert status[-1] in run, (run, status)
    order = [c["id"] for c in demo.config["components"]]
    assert order.index(by_elem["status"]) < order.index(by_elem["baseline"])


def test_the_examples_are_buttons_that_fill_a_valid_request(demo, app):
    assert len(EXAMPLES) >= 3
    for i, example in enumerate(EXAMPLES):
        (fn,) = events(demo, f"example-{i}", "click")
        out = _cleared(fn)
        assert (out["context"], out["emphasize"], out["suppress"], out["question"]) == (
            example.context,
            example.emphasize,
            example.suppress,
            example.question,
        )
        assert out["hint"] == example.note
        assert all(out[k] in ("", None) for k in (*PICKS, *RESULTS, "status"))
        app.parse(example.context, example.emphasize, example.suppress, 2.0, example.question)
    # Each is its own kind: emphasis, suppression, both.
    kinds = {(bool(e.emphasize), bool(e.suppress)) for e in EXAMPLES}
    assert kinds == {(True, False), (False, True), (True, True)}


def test_run_shows_the_difference_after_minus_before(demo, app):
    example = EXAMPLES[2]
    (run,) = events(demo, "run", "click")
    args = (example.context, example.emphasize, example.suppress, 4.0, example.question)
    out = _cleared(run, *args)
    assert out["status"].startswith("**Done**"), out["status"]
    diff, before, after = out["diff"], out["before"], out["after"]
    assert "Difference: after minus before" in diff

    def shares(view: str, unit: str) -> list[float]:
        return [float(x) for x in re.findall(rf'title="([-+\d.]+){unit}"', view)]

    got = shares(diff, " points")
    want = [a - b for a, b in zip(shares(after, "%"), shares(before, "%"), strict=True)]
    assert got == pytest.approx(want, abs=0.011)  # both rounded to 0.01
    assert any(g > 0 for g in got) and any(g < 0 for g in got)
    assert "rgba(22, 163, 74," in diff and "rgba(37, 99, 235," in diff  # gains and losses
    # /steer keeps its documented six outputs (no difference view).
    (steer,) = [f for f in demo.fns.values() if f.api_name == "steer"]
    assert [o.elem_id for o in steer.outputs] == [*RESULTS[:4], "cache", "status"]
    assert steer.fn(*args)[:2] == (out["baseline"], out["steered"])


def test_render_difference_escapes_and_refuses_other_tokens():
    context = "<b>x</b> y"
    before = [highlight.Piece(3, 4, 0.5), highlight.Piece(9, 10, 0.25)]
    after = [highlight.Piece(3, 4, 0.25), highlight.Piece(9, 10, 0.5)]
    view = highlight.render_difference(context, before, after, [(3, 4)], [])
    assert "<b>" not in view and "&lt;b&gt;" in view
    assert 'title="-25.00 points">x<' in view and 'title="+25.00 points">y<' in view
    with pytest.raises(ValueError, match="different tokens"):
        highlight.render_difference(context, before, after[:1], [], [])


@pytest.mark.real
def test_the_docs_focus_example_picks_on_smollm2(smollm2):
    """docs/app.md's ``/focus`` example (the first one-click example) picks its answer line on
    the app's default model; the example it replaced (Ann, Bo, Cy) picks nothing there."""
    model, tok = smollm2
    app = Highlighter(model, tok, "smollm2-135m-instruct")
    example = EXAMPLES[0]
    found = app.focus(example.context, example.question, 1)
    assert found.emphasize == example.emphasize
    assert [p["chosen"] for p in found.passages] == [False, False, True]
    old = app.focus(
        "Ann's number is 11.\nBo's number is 22.\nCy's number is 33.", "What is Bo's number?"
    )
    assert old.emphasize == "" and "Nothing picked" in old.status
