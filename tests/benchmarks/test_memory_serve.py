"""``benchmarks.memory_serve`` without a server: the synthetic messages, the per-turn accounting
from kvedit's and vLLM's response shapes, the summary statistics, the server command lines, and
the reading of a streamed response (a fake client standing in for ``openai``)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import memory_serve
from benchmarks.memory_serve import (
    _options,
    bytes_per_token,
    conversation_messages,
    kvedit_command,
    markdown,
    percentile,
    run_conversation,
    summarize,
    turn_buckets,
    turn_row,
    vllm_command,
)

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}
SMOLLM2 |= {"hidden_size": 576}


def words(text: str) -> int:
    return len(text.split())


def base(target: str, turn: int = 1, ttft: float = 0.1) -> dict:
    return {"target": target, "conversation": 0, "turn": turn, "ttft_s": ttft, "latency_s": 1.0}


# ------------------------------------------------------------------------------- messages


def test_the_messages_depend_on_the_seed_and_conversation_only():
    one = conversation_messages(3, 0, 4, 60, words)
    assert one == conversation_messages(3, 0, 4, 60, words)
    assert one != conversation_messages(4, 0, 4, 60, words)
    assert one != conversation_messages(3, 1, 4, 60, words)
    assert len(one) == 4


def test_each_message_reaches_its_size_with_as_few_facts_as_it_takes():
    for turn in conversation_messages(0, 2, 5, 60, words):
        assert words(turn.text) >= 60
        facts, question = turn.text.rsplit("\n", 1)
        fewer = facts.rsplit(" The code of box", 1)[0]  # the last fact left out
        assert words(fewer + "\n" + question) < 60
    tiny = conversation_messages(0, 0, 2, 1, words)
    assert all(t.text.count("The code of box") == 1 for t in tiny)  # at least one fact


def test_a_question_asks_a_fact_of_an_earlier_turn_and_boxes_are_distinct():
    turns = conversation_messages(1, 0, 6, 40, words)
    facts = [re.findall(r"The code of box (\d+) is (\d+)\.", t.text) for t in turns]
    boxes = [b for f in facts for b, _ in f]
    assert len(boxes) == len(set(boxes))
    assert (str(turns[0].box), turns[0].code) == facts[0][0]  # turn 1: its own first fact
    for i, t in enumerate(turns[1:], start=1):
        assert f"What is the code of box {t.box}?" in t.text
        assert (str(t.box), t.code) in [f for earlier in facts[:i] for f in earlier]


def test_messages_refuse_no_turns():
    with pytest.raises(ValueError, match="turns"):
        conversation_messages(0, 0, 0, 10, words)


# ----------------------------------------------------------------------------- accounting


def test_bytes_per_token_of_smollm2_in_float32():
    assert bytes_per_token(SMOLLM2) == 30 * 3 * 64 * 2 * 4 == 46080
    assert bytes_per_token(SimpleNamespace(**SMOLLM2, head_dim=128)) == 30 * 3 * 128 * 2 * 4
    assert bytes_per_token({**SMOLLM2, "num_key_value_heads": None}, 2) == 30 * 9 * 64 * 2 * 2


def test_a_kvedit_turn_takes_its_counts_from_kv_transfer_params():
    usage = {"prompt_tokens": 500, "completion_tokens": 16, "prompt_tokens_details": None}
    kv = {"digest": "ab", "served": 300, "computed": 200, "memory_digest": "cd"}
    kv |= {"memory_bytes": 1234, "forgot": 7, "error": "the worker saved nothing"}
    row = turn_row(base("kvedit", 2), usage, kv, 46080)
    assert row["error"] == "the worker saved nothing"
    assert row["computed"] == 200 and row["bytes_held"] == 1234
    assert row["bytes_how"] == "measured" and row["forgot"] == 7 and row["served"] == 300
    assert row["digest"] == "ab" and row["memory_digest"] == "cd"
    assert row["prompt_tokens"] == 500 and row["completion_tokens"] == 16 and row["turn"] == 2


def test_a_vllm_turn_counts_cached_tokens_and_estimates_its_blocks():
    usage = {"prompt_tokens": 500, "completion_tokens": 16}
    usage["prompt_tokens_details"] = {"cached_tokens": 256}
    row = turn_row(base("vllm"), usage, None, 46080, 128)
    assert row["computed"] == 244
    assert (
        row["bytes_held"] == math.ceil(516 / 128) * 128 * 46080 and row["bytes_how"] == "estimate"
    )
    assert turn_row(base("vllm"), usage, None, 10, 16)["bytes_held"] == 33 * 16 * 10


def test_a_response_without_what_its_accounting_needs_is_refused():
    with pytest.raises(ValueError, match="enable-prompt-tokens-details"):
        turn_row(base("vllm"), {"prompt_tokens": 5, "prompt_tokens_details": None}, None, 1)
    with pytest.raises(ValueError, match="kv_transfer_params"):
        turn_row(base("kvedit"), {"prompt_tokens": 5}, None, 1)
    with pytest.raises(ValueError, match="no usage"):
        turn_row(base("kvedit"), None, {"computed": 1}, 1)
    with pytest.raises(ValueError, match="7 tokens computed of a 5-token prompt"):
        turn_row(base("kvedit"), {"prompt_tokens": 5}, {"computed": 7}, 1)


# ----------------------------------------------------------------------------- statistics


def test_percentile_is_numpys_linear_one():
    xs = [0.3, 0.1, 0.9, 0.4, 0.25, 2.0, 0.05]
    for q in (0, 10, 50, 90, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert percentile([1.5], 90) == 1.5
    with pytest.raises(ValueError):
        percentile([], 50)


def test_turn_buckets_double_and_stop_at_the_last_turn():
    assert turn_buckets(1) == {"1": (1, 1)}
    assert turn_buckets(8) == {"1": (1, 1), "2-3": (2, 3), "4-7": (4, 7), "8": (8, 8)}
    assert list(turn_buckets(5)) == ["1", "2-3", "4-5"]


def test_the_summary_per_target_and_bucket_and_the_ratio():
    rows = []
    for target, scale, held in (("kvedit", 1.0, 100), ("vllm", 4.0, 1000)):
        for conv in range(2):
            for turn in (1, 2, 3):
                row = base(target, turn, scale * (turn + conv))
                row |= {"conversation": conv, "computed": 10 * turn, "correct": turn == 1}
                row |= {"bytes_held": held * turn + conv, "bytes_how": "x"}
                rows.append(row)
    out = summarize(rows, {"kvedit": 2.0, "vllm": 3.0})
    kv, vl = out["targets"]["kvedit"], out["targets"]["vllm"]
    assert kv["requests"] == 6 and kv["requests_per_s"] == 3.0 and vl["requests_per_s"] == 2.0
    assert kv["mean_computed"] == 20 and kv["buckets"]["2-3"]["mean_computed"] == 25
    assert kv["max_bytes_per_conversation"] == 301 and vl["max_bytes_per_conversation"] == 3001
    assert kv["correct"] == pytest.approx(1 / 3)
    assert kv["turns_not_kept"] == 0
    rows[0]["error"] = "kept nothing"
    assert summarize(rows, {"kvedit": 1.0})["targets"]["kvedit"]["turns_not_kept"] == 1
    assert kv["buckets"]["1"]["ttft_median_s"] == 1.5  # conversations 0 and 1: 1.0 and 2.0 s
    assert kv["buckets"]["2-3"]["ttft_p90_s"] == pytest.approx(np.percentile([2, 3, 3, 4], 90))
    assert out["ttft_ratio_kvedit_over_vllm"] == {"1": 0.25, "2-3": 0.25}
    assert "ttft_ratio_kvedit_over_vllm" not in summarize(rows[:6], {"kvedit": 1.0})
    table = "\n".join(markdown(out))
    assert "| kvedit | 2-3 | 4 | 3.000 |" in table and "| 0.25 |" in table
    assert "| vllm | 2.00 | 20.0 | 0.00 (x) | 33% |" in table


# ------------------------------------------------------------------------------- commands


def test_the_kvedit_command_passes_the_memory_options_it_is_given():
    cmd = kvedit_command("smollm2-135m-instruct", "/tmp/r", 8123, "8MiB", "learned")
    assert cmd[1:5] == ["-m", "kvedit", "serve", "--model"]
    assert cmd[cmd.index("--root") + 1] == "/tmp/r" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--memory-max-bytes") + 1] == "8MiB"
    assert cmd[cmd.index("--forget") + 1] == "learned"
    bare = kvedit_command("m", "/tmp/r", 1, None, None)
    assert "--memory-max-bytes" not in bare and "--forget" not in bare


def test_the_vllm_command_turns_prefix_caching_and_cached_counts_on():
    cmd = vllm_command("/models/smollm2", "smollm2-135m-instruct", 8124)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == "/models/smollm2"
    assert cmd[cmd.index("--served-model-name") + 1] == "smollm2-135m-instruct"
    for flag in ("--enable-prefix-caching", "--enforce-eager", "--enable-prompt-tokens-details"):
        assert flag in cmd
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"
    assert cmd[cmd.index("--port") + 1] == "8124"


def test_a_target_needs_a_url_or_start(capsys):
    with pytest.raises(SystemExit):
        _options(["--targets", "vllm"])
    assert "target vllm needs --vllm-url or --start" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _options(["--targets", "kvedit,sglang", "--start"])
    assert "sglang" in capsys.readouterr().err
    args = _options(["--targets", "vllm", "--vllm-url", "http://x", "--forget", "none"])
    assert args.targets == ["vllm"] and args.forget is None and args.memory_max_bytes == "8MiB"


# ---------------------------------------------------------------------- a streamed answer


def _chunk(content=None, finish=None, usage=None, extra=None):
    choices = (
        []
        if content is None and finish is None
        else [SimpleNamespace(delta=SimpleNamespace(content=content), finish_reason=finish)]
    )
    dumped = None if usage is None else SimpleNamespace(model_dump=lambda: usage)
    return SimpleNamespace(choices=choices, usage=dumped, model_extra=extra or {})


class FakeClient:
    """Streams a fixed answer, one chunk per tick of a fake clock (``now``); remembers the
    messages of each request (copied)."""

    def __init__(self):
        self.requests = []
        self.now = 0.0
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, model, messages, stream, **kw):
        assert stream and kw["temperature"] == 0 and kw["stream_options"]["include_usage"]
        self.requests.append([dict(m) for m in messages])
        n = len(self.requests)
        kv = {"computed": 3 * n, "memory_bytes": 100 * n, "served": 0, "forgot": 0}
        chunks = [
            _chunk(content=""),  # the role chunk: no content, not the first token
            _chunk(content="The code is "),
            _chunk(content="4821.", finish="stop"),
            _chunk(usage={"prompt_tokens": 10 * n, "completion_tokens": 4}),
            _chunk(extra={"kv_transfer_params": {"kvedit": kv}}),
        ]
        return self.ticking(chunks)

    def ticking(self, chunks):
        for chunk in chunks:
            self.now += 1
            yield chunk


def test_a_conversation_reads_the_stream_and_sends_the_answers_back(monkeypatch):
    client = FakeClient()
    monkeypatch.setattr(memory_serve.time, "perf_counter", lambda: client.now)
    turns = conversation_messages(0, 0, 2, 5, words)
    turns[0] = turns[0].__class__(turns[0].text, turns[0].box, "4821")
    args = SimpleNamespace(answer_tokens=8, accounting=(1, 128))
    rows = run_conversation(client, "kvedit", "m", 0, turns, args)
    assert [r["computed"] for r in rows] == [3, 6] and [r["bytes_held"] for r in rows] == [100, 200]
    assert [r["prompt_tokens"] for r in rows] == [10, 20]
    assert rows[0]["answer"] == "The code is 4821." and rows[0]["correct"]
    assert not rows[1]["correct"]
    # TTFT: the second chunk (the first with content) after the request; latency: the last
    assert [(r["ttft_s"], r["latency_s"]) for r in rows] == [(2, 5), (2, 5)]
    second = client.requests[1]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == "The code is 4821." and second[2]["content"] == turns[1].text
