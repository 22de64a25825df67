"""``kvedit publish``, ``kvedit serve``'s command, and ``--engine`` checks: no vLLM needed.

The served answers are checked in ``test_vllm_engine_serve.py`` and
``test_vllm_engine_evals.py`` (vLLM venv).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import kvedit
from kvedit.cli import main as cli_main
from kvedit.cli import run as cli_run
from kvedit.errors import CacheNotServedError, InvalidInputError, VLLMUnavailableError
from kvedit.evals.engines import check_engine
from kvedit.evals.jsonl import reused_records
from kvedit.evals.methods import ExampleContext, parse_spec
from kvedit.evals.methods.none import UNEDITED_ANSWER
from kvedit.evals.tasks.records import records_examples
from kvedit.focusing.choice import QUESTION_MARK
from kvedit.integrations.vllm import connector_config, files, to_stock
from kvedit.integrations.vllm.answer import VLLMAnswerer, check_served
from kvedit.integrations.vllm.contexts import publish_context
from kvedit.integrations.vllm.server import serve, serve_command

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def example():
    ex = records_examples(positions=[6], trials=1, n_records=10)[0]
    context = ex.user_message().split(QUESTION_MARK)[0]
    return ex, context


def test_publish_context_writes_what_it_says_to_send(smollm2, example, tmp_path):
    model, tok = smollm2
    ex, context = example
    got = publish_context(
        model, tok, context, tmp_path, question=ex.question, suppress=[ex.gold_document]
    )
    prefix, continuation = kvedit.chat_prefix(
        tok, context + QUESTION_MARK + " " + ex.question, QUESTION_MARK
    )
    edited = kvedit.ops.suppress(kvedit.capture(model, tok, prefix), ex.gold_document, 1e4)
    want = to_stock(edited)
    assert got.published_token_ids == want.token_ids
    assert got.prompt_token_ids == want.token_ids + edited.encode(continuation)
    assert got.continuation == continuation and got.exact
    meta, tensors = files.read(got.file)
    assert meta["token_ids"] == got.published_token_ids
    for i in (0, len(want.keys) - 1):
        assert torch.equal(tensors[f"layer.{i}.keys"], want.keys[i])
        assert torch.equal(tensors[f"layer.{i}.values"], want.values[i])
    assert len(got.published_token_ids) < len(edited.token_ids)  # the gold record is gone
    body = got.request(max_tokens=8)
    assert body == {
        "model": "",
        "prompt": got.prompt_token_ids,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,  # vLLM's own EOS ids off: it stops where kvedit stops
        "stop_token_ids": sorted(kvedit.states.decoding.eos_ids(model, tok)),
        "return_token_ids": True,
        "kv_transfer_params": {"kvedit": {"digest": got.digest}},
    }
    assert got.digest == edited.digest == files.digest_of(got.file)  # exact: no label
    printed = json.loads(json.dumps(got.to_dict()))  # what kvedit publish prints
    assert printed["digest"] == got.digest
    assert printed["published_token_ids"] == got.published_token_ids
    assert got.served == len(got.published_token_ids) and Path(got.file).is_absolute()


def test_publish_without_a_question_gives_a_template(smollm2, example, tmp_path):
    model, tok = smollm2
    _, context = example
    got = publish_context(model, tok, context, tmp_path)
    assert got.prompt_token_ids is None and "{question}" in got.continuation
    with pytest.raises(InvalidInputError, match="no question"):
        got.request()


def test_focus_publishes_the_chosen_passage_emphasized(smollm2, example, tmp_path):
    """focus asks layers for different biases: vLLM realises them approximately, so it is
    published only when asked, and labelled."""
    model, tok = smollm2
    ex, context = example
    # the unedited answer already comes from the gold record: the default guard makes no edit,
    # so nothing is chosen and the cache is published exactly
    guarded = publish_context(model, tok, context, tmp_path, focus_on=ex.question)
    assert guarded.exact and guarded.chosen == []
    before = set(tmp_path.glob("*.safetensors"))
    with pytest.raises(InvalidInputError, match="approximate=True"):
        publish_context(model, tok, context, tmp_path, focus_on=ex.question, guard=None)
    assert set(tmp_path.glob("*.safetensors")) == before  # refused before anything is written
    got = publish_context(
        model, tok, context, tmp_path, focus_on=ex.question, approximate=True, guard=None
    )
    assert set(tmp_path.glob("*.safetensors")) - before
    assert not got.exact and "approximation" in json.dumps(files.read_header(got.file)["history"])
    assert got.question == ex.question and len(got.chosen) == 1
    assert got.chosen[0].strip() == ex.gold_document
    plain = publish_context(model, tok, context, tmp_path, question=ex.question)
    assert len(got.published_token_ids) > len(plain.published_token_ids)  # copies of the gold
    assert "copies" in got.report and got.continuation == plain.continuation


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"suppress": ["Diego"], "suppress_strength": 2.0}, "cannot be served"),
        ({"question": "a", "focus_on": "b"}, "different questions"),
        ({"prompt": "markdown"}, "unknown prompt format"),
        ({"emphasize": ["Diego"], "strength": 0.3}, "log 1.5"),  # rounds to 0 copies
    ],
)
def test_what_vllm_cannot_serve_is_refused_and_nothing_written(
    smollm2, example, tmp_path, kwargs, match
):
    model, tok = smollm2
    _, context = example
    with pytest.raises(InvalidInputError, match=match):
        publish_context(model, tok, context, tmp_path / "root", **kwargs)
    assert not list((tmp_path / "root").glob("*.safetensors"))


def test_publish_refuses_a_guard_without_decide_before_capturing(example, tmp_path, monkeypatch):
    from kvedit.errors import InvalidTypeError
    from kvedit.integrations.vllm import contexts

    _, context = example
    monkeypatch.setattr(contexts, "capture", lambda *a, **k: pytest.fail("captured"))
    monkeypatch.setattr(contexts, "text_focused", lambda *a, **k: pytest.fail("focused"))
    with pytest.raises(InvalidTypeError, match="guard must have a decide"):
        publish_context(None, None, context, tmp_path, focus_on="Who?", guard="none")
    assert not list(tmp_path.iterdir())


def test_a_context_with_the_question_mark_is_refused(smollm2, tmp_path):
    model, tok = smollm2
    with pytest.raises(InvalidInputError, match="must not contain"):
        publish_context(model, tok, "a" + QUESTION_MARK + " b", tmp_path)


def test_publish_cli_prints_the_request(example, tmp_path, capsys):
    ex, context = example
    path = tmp_path / "context.txt"
    path.write_text(context)
    req = tmp_path / "request.json"
    args = ["publish", "--root", str(tmp_path / "pub"), "--context", str(path)]
    args += ["--question", ex.question, "--emphasize", ex.gold_document]
    args += ["--strength", str(math.log(4)), "--request", str(req), "--max-tokens", "5"]
    assert cli_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"] and out["model"] == "smollm2-135m-instruct"
    assert out["request"] == json.loads(req.read_text())
    assert out["request"]["kv_transfer_params"] == {"kvedit": {"digest": out["digest"]}}
    assert Path(out["file"]).name.endswith(out["digest"] + ".safetensors")
    assert out["request"]["prompt"] == out["prompt_token_ids"]
    assert out["request"]["max_tokens"] == 5
    assert Path(out["file"]).parent == tmp_path / "pub"


def test_publish_cli_refuses_a_request_file_without_a_question(tmp_path, capsys):
    path = tmp_path / "context.txt"
    path.write_text("Some text.")
    args = ["publish", "--context", str(path), "--request", str(tmp_path / "r.json")]
    assert cli_main(args) == 2
    assert "kvedit publish: error: --request needs" in capsys.readouterr().err


def test_publish_cli_guard_none_keeps_focus_edit(example, tmp_path, capsys):
    ex, context = example
    path = tmp_path / "context.txt"
    path.write_text(context)
    args = ["publish", "--root", str(tmp_path / "pub"), "--context", str(path)]
    args += ["--focus", ex.question, "--approximate", "--max-tokens", "5"]
    assert cli_main(args) == 0  # the default guard: the unedited answer is the gold's
    assert json.loads(capsys.readouterr().out)["chosen"] == []
    assert cli_main([*args, "--guard", "none"]) == 0
    (chosen,) = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen.strip() == ex.gold_document
    question = ["--question", ex.question]
    assert cli_main([*args[:5], *question, "--guard", "none"]) == 2
    assert "--guard needs --focus" in capsys.readouterr().err


def test_serve_command_configures_the_connector(smollm2, tmp_path):
    model, _ = smollm2
    argv = serve_command("smollm2-135m-instruct", tmp_path / "root", port=8123, cpu=True)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    opts = dict(zip(argv[3::1], argv[4::1], strict=False))
    assert opts["--model"] == model.config._name_or_path
    assert opts["--served-model-name"] == "smollm2-135m-instruct"
    assert opts["--port"] == "8123" and opts["--dtype"] == "float32"
    config = json.loads(opts["--kv-transfer-config"])
    want = connector_config(tmp_path / "root", kvedit.fingerprint.model_fingerprint(model))
    assert config == want and config["kv_connector_extra_config"]["model_fingerprint"]
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    assert opts["--generation-config"] == "vllm"  # no sampling defaults from the model
    assert opts["--kv-cache-memory-bytes"] == str(1 << 30)
    assert (tmp_path / "root").is_dir()


def test_serve_command_passes_vllm_arguments_on(tmp_path):
    extra = ["--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "2"]
    argv = serve_command("smollm2-135m-instruct", tmp_path, vllm_args=extra, cpu=False)
    assert argv[-4:] == extra
    assert "--enforce-eager" not in argv and "--kv-cache-memory-bytes" not in argv
    argv = serve_command("smollm2-135m-instruct", tmp_path, vllm_args=extra[:2], cpu=True)
    assert "--kv-cache-memory-bytes" not in argv  # the caller sized the memory
    argv = serve_command(
        "smollm2-135m-instruct", tmp_path, vllm_args=["--gpu_memory_utilization=.5"], cpu=True
    )
    assert "--kv-cache-memory-bytes" not in argv  # vLLM reads underscores as dashes
    with pytest.raises(InvalidInputError, match="port"):
        serve_command("smollm2-135m-instruct", tmp_path, port=0)
    with pytest.raises(InvalidInputError, match="load_failure"):  # before loading the model
        serve_command("no-such-model", tmp_path, load_failure="retry")


@pytest.mark.parametrize(
    "arg",
    [
        "--kv-transfer-config={}",
        "--kv_transfer_config={}",  # vLLM turns underscores into dashes
        "--kv-transfer-config.kv_load_failure_policy",  # a dotted sub-key replaces the JSON
        "--kv-transfer-c",  # argparse takes unique abbreviations
        "--model",
        "--tokenizer=other",
        "--enable-prefix-caching",
        "--generation-config=auto",
        "--config",
    ],
)
def test_serve_refuses_what_would_change_the_answer_in_any_spelling(tmp_path, arg):
    with pytest.raises(InvalidInputError, match="refuses the vLLM argument"):
        serve_command("smollm2-135m-instruct", tmp_path, vllm_args=[arg, "x"], cpu=True)


def test_serve_needs_vllm(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(VLLMUnavailableError, match="kvedit\\[vllm\\]"):
        serve("smollm2-135m-instruct", tmp_path, dry_run=True)


# ---------------------------------------------------------------- --engine


@pytest.mark.parametrize("spec", ["closedbook", "auto:edit=steer", "oracle:edit=steer", "snapkv"])
def test_the_vllm_engine_refuses_methods_that_do_not_answer_from_a_state(spec):
    with pytest.raises(InvalidInputError, match=f"not {spec}"):
        check_engine("vllm", [parse_spec("none"), parse_spec(spec)])
    assert check_engine("transformers", [parse_spec(spec)]) == "transformers"


def test_an_unknown_engine_is_refused():
    with pytest.raises(InvalidInputError, match="unknown engine"):
        check_engine("tgi", [parse_spec("none")])


def test_the_cli_refuses_a_method_vllm_cannot_serve_before_loading(tmp_path, capsys):
    args = ["eval", "litm", "--engine", "vllm", "--methods", "none,closedbook"]
    assert cli_main([*args, "--model", "no-such-model", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "kvedit eval litm: error: " in err and "closedbook" in err


def test_the_vllm_engine_needs_vllm_before_loading(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    args = ["eval", "litm", "--engine", "vllm", "--model", "no-such-model", "--out", str(tmp_path)]
    assert cli_main(args) == 1
    assert "make vllm-setup" in capsys.readouterr().err.splitlines()[-1]
    with pytest.raises(VLLMUnavailableError, match="make vllm-setup"):
        cli_run(args)
    with pytest.raises(InvalidInputError, match="batch"):
        check_engine("vllm", [parse_spec("none")], batch=0)


def test_resume_never_mixes_engines(tmp_path):
    from kvedit.evals.litm import evaluate

    common = dict(methods=["none"], task="records", n_docs=4, positions=[0], trials=1)
    evaluate("tiny-llama", out=tmp_path, progress=False, max_new_tokens=2, **common)
    settings = {"model": "tiny-llama", "task": "records", "seed": 0, "prompt": "chat"}
    settings |= {"max_new_tokens": 2, "engine": "vllm", "params": {"none": {}}}
    (tmp_path / "partial.settings.json").write_text(json.dumps(settings))
    (tmp_path / "partial.jsonl").write_text("")
    with pytest.raises(InvalidInputError, match="engine 'vllm'"):
        evaluate("tiny-llama", out=tmp_path, resume=True, max_new_tokens=2, **common)


def test_reuse_never_mixes_engines(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(
        json.dumps(
            {
                "model": "m",
                "task": "records",
                "extra": {"seed": 0, "prompt": "chat", "engine": "vllm"},
                "examples": [],
            }
        )
    )
    with pytest.raises(InvalidInputError, match="'vllm' engine"):
        reused_records(path, "m", "records", 0, {}, "chat", "transformers")
    assert reused_records(path, "m", "records", 0, {}, "chat", "vllm") == {}


@pytest.mark.parametrize(
    "spec,prompt",
    [
        ("none", "chat"),
        ("oracle", "chat"),
        ("oracle:edit=duplicate:copies=2", "chat"),
        ("auto", "chat"),
        ("auto:guard=True", "chat"),  # the guard's verdict answer is reused by predict
        ("auto:edit=scale_keys", "plain"),
        ("reread", "chat"),
    ],
)
def test_a_method_answers_from_its_answer_state(smollm2, spec, prompt):
    """What the vLLM engine serves (answer_state, continued greedily) is what predict answers,
    and both leave the same notes."""
    model, tok = smollm2
    ex = records_examples(positions=[3], trials=1, n_records=6)[0]
    method = parse_spec(spec)
    assert method.answers_from_state
    ctx = ExampleContext(model, tok, ex, max_new_tokens=8, prompt_format=prompt)
    state = method.answer_state(ctx)
    other = ExampleContext(model, tok, ex, max_new_tokens=8, prompt_format=prompt)
    assert method.predict(other) == state.generate(ctx.continuation, 8)
    # predict's `none` also leaves its answer for focus on the same example to read (eval time
    # only, never recorded); every other note is the same both ways
    assert ctx.notes.keys() == other.notes.keys() - {UNEDITED_ANSWER}
    if "auto_choice" in ctx.notes:
        assert list(ctx.notes["auto_choice"]) == list(other.notes["auto_choice"])
    assert ("auto_choice" in ctx.notes) == (spec != "none" and not spec.startswith("oracle"))


# ---------------------------------------------------------------- the answerer, on a fake engine


class FakeLLM:
    """Stands in for vllm.LLM: serves each prompt from the published file whose digest its
    request names (as the connector does), answering with the round number; records what it
    saw."""

    def __init__(self, root, outcome=None):
        self.index = files.PublishedIndex(root)
        self.rounds: list[list[str]] = []
        self.outcome = outcome  # overrides the connector's report

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        seen, outs = [], []
        for p, digest in zip(prompts, params, strict=True):
            path, n = self.index.find(p["prompt_token_ids"], digest)
            seen.append(files.read_header(path)["seal"]["tensors"])
            report = {"served": n, "published": n, "file": path.name, "digest": digest}
            outs.append(
                SimpleNamespace(
                    outputs=[
                        SimpleNamespace(token_ids=[len(self.rounds) + 7], finish_reason="stop")
                    ],
                    kv_transfer_params={"kvedit": self._report(report)},
                )
            )
        self.rounds.append(seen)
        return outs

    def _report(self, report):
        if self.outcome is None:
            return report
        return self.outcome(report) if callable(self.outcome) else self.outcome


class FakeAnswerer(VLLMAnswerer):
    def _sampling(self, max_new_tokens, digest):
        return digest


@pytest.fixture
def fake(smollm2, tmp_path):
    model, tok = smollm2
    ex = records_examples(positions=[3], trials=1, n_records=6)[0]
    ctx = ExampleContext(model, tok, ex, max_new_tokens=4)
    llm = FakeLLM(tmp_path)
    return FakeAnswerer(model, tok, tmp_path, llm=llm), llm, ctx


def edited(state, op, *args):
    """An edit with its step in the history (added here if this checkout's op does not
    record it yet)."""
    from kvedit.provenance import Step

    out = getattr(kvedit.ops, op)(state, *args)
    return out.with_step(Step("edit", op)) if out.is_plain_capture else out


def test_states_with_the_same_ids_are_answered_each_from_its_own_file(fake, tmp_path):
    """Files are named by digest: the plain state and its scale_keys edit (the same ids) are
    published side by side and answered in one round, each from its own file."""
    answerer, llm, ctx = fake
    plain = ctx.state
    scaled = edited(plain, "scale_keys", ctx.gold_span(), 0.5)  # the same token ids
    duplicated = edited(plain, "duplicate", ctx.gold_span(), 2)
    for state in (plain, scaled, duplicated):
        answerer.submit(state, ctx.continuation, 4)
    assert len(list(answerer.root.glob("*.safetensors"))) == 3
    answers = answerer.flush()
    crc = [
        files.read_header(files.write(to_stock(s), tmp_path / f"ref{i}", "x"))["seal"]["tensors"]
        for i, s in enumerate((plain, scaled, duplicated))
    ]
    assert llm.rounds == [crc]  # each prompt read its own state's file, in one round
    assert [a.digest for a in answers] == [s.digest for s in (plain, scaled, duplicated)]
    assert all(a.exact and a.approximation is None for a in answers)
    assert not list(answerer.root.glob("*.safetensors"))  # answered files are removed


def test_the_answerer_applies_the_rule(fake):
    """Approximate states only when the answerer was built to serve them, labelled; states
    nothing of whose edit vLLM realises never (nothing is published)."""
    answerer, llm, ctx = fake
    approx = kvedit.ops.emphasize(ctx.state, ctx.gold_span(), 2.0)  # 6 copies = 1.946 nats
    with pytest.raises(InvalidInputError, match="approximate=True"):
        answerer.submit(approx, ctx.continuation, 4)
    lost = kvedit.ops.suppress(ctx.state, ctx.gold_span(), 2.0)
    with pytest.raises(InvalidInputError, match="cannot be served"):
        answerer.submit(lost, ctx.continuation, 4)
    assert not list(answerer.root.glob("*.safetensors"))
    answerer.approximate = True
    with pytest.raises(InvalidInputError, match="cannot be served"):
        answerer.submit(lost, ctx.continuation, 4)
    answerer.submit(approx, ctx.continuation, 4)
    (got,) = answerer.flush()
    assert not got.exact and got.approximation["approximate_biases"] > 0
    assert got.digest != approx.digest  # the labelled state's


@pytest.mark.parametrize(
    "outcome,match",
    [
        ({"refused": "mismatch"}, "did not serve"),
        (  # a longer file that starts with the same ids was served: all tokens "served"
            lambda r: {
                **r,
                "served": r["served"] + 3,
                "published": r["published"] + 3,
                "file": "x",
            },
            "did not serve",
        ),
        (lambda r: {**r, "digest": "f" * 32}, "did not serve"),  # another state's file
    ],
)
def test_an_answer_not_served_from_its_own_file_raises_and_drops_the_flush(fake, outcome, match):
    answerer, llm, ctx = fake
    llm.outcome = outcome
    answerer.submit(ctx.state, ctx.continuation, 4)
    with pytest.raises(CacheNotServedError, match=match):
        answerer.flush()
    assert not list(answerer.root.glob("*.safetensors"))  # the published file is gone
    llm.outcome = None
    answerer.submit(ctx.state, ctx.continuation, 4)
    assert len(answerer.flush()) == 1  # nothing of the failed flush comes back


def test_check_served_needs_the_whole_file():
    from types import SimpleNamespace

    def out(reason="stop", **kv):
        return SimpleNamespace(
            outputs=[SimpleNamespace(finish_reason=reason, token_ids=[])],
            kv_transfer_params={"kvedit": kv},
        )

    assert (
        check_served(out(served=9, published=9, file="9-a.safetensors"), "9-a.safetensors", 9) == 9
    )
    with pytest.raises(CacheNotServedError, match="error"):
        check_served(
            out("error", served=9, published=9, file="9-a.safetensors"), "9-a.safetensors", 9
        )
    with pytest.raises(CacheNotServedError):
        check_served(out(served=8, published=9, file="9-a.safetensors"), "9-a.safetensors", 9)
    ok = out(served=9, published=9, file="9-a.safetensors", digest="d" * 32)
    assert check_served(ok, "9-a.safetensors", 9, "d" * 32) == 9
    with pytest.raises(CacheNotServedError, match="digest"):
        check_served(ok, "9-a.safetensors", 9, "e" * 32)


def test_the_answerer_refuses_recompute_and_empty_continuations(fake, smollm2):
    answerer, _, ctx = fake
    model, tok = smollm2
    with pytest.raises(InvalidInputError, match="load_failure"):
        VLLMAnswerer(model, tok, answerer.root, llm=object(), load_failure="recompute")
    with pytest.raises(InvalidInputError, match="continuation is empty"):
        answerer.submit(ctx.state, "", 4)


# ---------------------------------------------------------------- --engine vllm: the rule


def test_the_vllm_engine_refuses_an_approximate_method_unless_asked(fake):
    """oracle emphasizes the gold document by 2.0 nats: 6 copies on vLLM, 1.946 nats. Without
    approximate the run stops before serving it, naming the method and the flag; with it,
    each record and the summary say how much was served exactly."""
    from kvedit.evals.engines import run_on_vllm
    from kvedit.evals.report import format_table, summarize

    pytest.importorskip("vllm", reason="run_on_vllm checks that vLLM is installed")
    answerer, _, ctx = fake
    methods = [parse_spec("none"), parse_spec("oracle")]
    args = (ctx.model, ctx.tokenizer, [ctx.example], methods, 4, "chat", {})
    with pytest.raises(InvalidInputError, match=r"method oracle.*approximate=True"):
        run_on_vllm(*args, progress=False, answerer=answerer)
    answerer.approximate = True
    records, _ = run_on_vllm(*args, progress=False, answerer=answerer)
    none, oracle = records
    assert none["exact"] and "approximation" not in none
    assert not oracle["exact"] and oracle["approximation"]["approximate_biases"] > 0
    summary = summarize(records)
    assert (summary["none"]["exact_share"], summary["oracle"]["exact_share"]) == (1.0, 0.0)
    table = format_table(summary).splitlines()
    assert table[0].split()[-1] == "exact"
    assert table[2].split()[-1] == "1.000" and table[3].split()[-1] == "0.000"
    plain = {k: v for k, v in none.items() if k != "exact"}  # the transformers engine's
    assert "exact" not in format_table(summarize([plain])).split()
