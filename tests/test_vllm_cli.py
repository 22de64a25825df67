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
from kvedit.errors import InvalidInputError, VLLMUnavailableError
from kvedit.evals.engines import check_engine
from kvedit.evals.litm import _reused
from kvedit.evals.methods import ExampleContext, parse_spec
from kvedit.evals.tasks.records import records_examples
from kvedit.focus import QUESTION_MARK
from kvedit.integrations.vllm import connector_config, files, to_stock
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
    }


def test_publish_without_a_question_gives_a_template(smollm2, example, tmp_path):
    model, tok = smollm2
    _, context = example
    got = publish_context(model, tok, context, tmp_path)
    assert got.prompt_token_ids is None and "{question}" in got.continuation
    with pytest.raises(InvalidInputError, match="no question"):
        got.request()


def test_focus_publishes_the_chosen_passage_emphasized(smollm2, example, tmp_path):
    model, tok = smollm2
    ex, context = example
    got = publish_context(model, tok, context, tmp_path, focus_on=ex.question)
    assert got.question == ex.question and len(got.chosen) == 1
    assert got.chosen[0].strip() == ex.gold_document
    plain = publish_context(model, tok, context, tmp_path, question=ex.question)
    assert len(got.published_token_ids) > len(plain.published_token_ids)  # copies of the gold
    assert "copies" in got.report and got.continuation == plain.continuation


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"suppress": ["Diego"], "suppress_strength": 2.0}, "cannot be realised"),
        ({"question": "a", "focus_on": "b"}, "different questions"),
        ({"prompt": "markdown"}, "unknown prompt format"),
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
    assert out["request"]["prompt"] == out["prompt_token_ids"]
    assert out["request"]["max_tokens"] == 5
    assert Path(out["file"]).parent == tmp_path / "pub"


def test_publish_cli_refuses_a_request_file_without_a_question(tmp_path):
    path = tmp_path / "context.txt"
    path.write_text("Some text.")
    with pytest.raises(InvalidInputError, match="--request needs"):
        cli_main(["publish", "--context", str(path), "--request", str(tmp_path / "r.json")])


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
    assert opts["--kv-cache-memory-bytes"] == str(1 << 30)
    assert (tmp_path / "root").is_dir()


def test_serve_command_passes_vllm_arguments_on(tmp_path):
    extra = ["--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "2"]
    argv = serve_command("smollm2-135m-instruct", tmp_path, vllm_args=extra, cpu=False)
    assert argv[-4:] == extra
    assert "--enforce-eager" not in argv and "--kv-cache-memory-bytes" not in argv
    argv = serve_command("smollm2-135m-instruct", tmp_path, vllm_args=extra[:2], cpu=True)
    assert "--kv-cache-memory-bytes" not in argv  # the caller sized the memory
    with pytest.raises(InvalidInputError, match="kv-transfer-config"):
        serve_command("smollm2-135m-instruct", tmp_path, vllm_args=["--kv-transfer-config={}"])
    with pytest.raises(InvalidInputError, match="port"):
        serve_command("smollm2-135m-instruct", tmp_path, port=0)


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


def test_the_cli_refuses_a_method_vllm_cannot_serve_before_loading(tmp_path):
    args = ["eval", "litm", "--engine", "vllm", "--methods", "none,closedbook"]
    with pytest.raises(InvalidInputError, match="closedbook"):
        cli_main([*args, "--model", "no-such-model", "--out", str(tmp_path)])


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
        _reused(path, "m", "records", 0, {}, "chat", "transformers")
    assert _reused(path, "m", "records", 0, {}, "chat", "vllm") == {}


@pytest.mark.parametrize(
    "spec", ["none", "oracle", "oracle:edit=duplicate:copies=2", "auto", "reread"]
)
def test_a_method_answers_from_its_answer_state(smollm2, spec):
    """What the vLLM engine serves (answer_state, continued greedily) is what predict answers."""
    model, tok = smollm2
    ex = records_examples(positions=[3], trials=1, n_records=6)[0]
    method = parse_spec(spec)
    assert method.answers_from_state
    ctx = ExampleContext(model, tok, ex, max_new_tokens=8)
    state = method.answer_state(ctx)
    notes = dict(ctx.notes)
    ctx.notes.clear()
    assert method.predict(ExampleContext(model, tok, ex, max_new_tokens=8)) == state.generate(
        ctx.continuation, 8
    )
    if spec in ("auto", "reread"):
        assert "auto_choice" in notes
