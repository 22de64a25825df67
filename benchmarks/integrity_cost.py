"""What keeping a state honest costs: capture, extend, save, load (first and repeated) and
publish of a state of N tokens, and a question asked over the loaded state against the same
question over the state in memory.

Uses only kvedit's public API, so the same file times another checkout of kvedit too:
``PYTHONPATH=OTHER_CHECKOUT python benchmarks/integrity_cost.py`` (run from that checkout's
root), next to ``python -m benchmarks.integrity_cost`` here. Prints one JSON object of median
seconds (``--repeats`` runs each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import kvedit

WORDS = "The archive keeps a note on every shipment that left the harbour that winter. "


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model_name: str, tokens: int, repeats: int) -> dict:
    """Median seconds of each operation on a ``tokens``-token state of ``model_name``."""
    from kvedit.integrations.vllm import publish

    model, tok = kvedit.load_model(model_name)
    text = WORDS * (tokens // len(tok(WORDS)["input_ids"]) + 1)
    text = tok.decode(tok(text)["input_ids"][:tokens], skip_special_tokens=True)
    question = " Question: which ship left first? Answer:"
    out: dict = {"model": model_name, "tokens": tokens, "repeats": repeats}
    state = kvedit.capture(model, tok, text)
    out["capture_s"] = _median(lambda: kvedit.capture(model, tok, text), repeats)
    out["extend_s"] = _median(lambda: state.extend(" One more line."), repeats)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.kv"
        out["save_s"] = _median(lambda: state.save(path), repeats)
        out["file_mb"] = round(path.stat().st_size / 2**20, 1)
        firsts = []
        for i in range(repeats):  # a new file version each time: hashed on its first load
            fresh = Path(folder) / f"fresh{i}.kv"
            state.save(fresh)
            t0 = time.perf_counter()
            kvedit.load_state(fresh, model, tok)
            firsts.append(time.perf_counter() - t0)
        out["load_first_s"] = statistics.median(firsts)
        out["load_again_s"] = _median(lambda: kvedit.load_state(path, model, tok), repeats)
        ask = lambda s: s.generate(question, 1)  # noqa: E731 - time to first token
        out["ask_memory_s"] = _median(lambda: ask(state), repeats)
        out["ask_loaded_s"] = _median(lambda: ask(kvedit.load_state(path, model, tok)), repeats)
        out["loaded_over_memory"] = out["ask_loaded_s"] / out["ask_memory_s"]
        out["publish_s"] = _median(lambda: publish(state, Path(folder) / "pub"), repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    p.add_argument("--tokens", type=int, default=2048, help="the state's length in tokens")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per number (median)")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.tokens, args.repeats), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
