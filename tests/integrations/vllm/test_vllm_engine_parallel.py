"""The kvedit connector under vLLM tensor and pipeline parallelism, on CPU (two worker processes).

* Tensor parallel 2 with Gemma-3-270M: its one KV head is replicated on both ranks (vLLM's rule,
  :mod:`kvedit.integrations.vllm.heads`), and each rank loads it from the shared file.
* Pipeline parallel 2 with SmolLM2-135M: each stage loads its own 15 of the 30 layers; the
  scheduler checks the file against all 30.

Each test starts its own engine (~50-65 s on 2 cores; both cores busy while it runs) and checks
vLLM's greedy output against ``state.answer`` token for token, for the plain state and for a
``scale_keys`` edit that changes the answer (a load that failed would be recomputed by vLLM and
give the plain state's answer instead). vLLM's CPU backend needs the threads of each worker
bound by hand on a one-NUMA-node machine (``VLLM_CPU_OMP_THREADS_BIND``), and pipeline
parallelism on CPU needs the model warmed up (``enforce_eager=False`` and a KV cache sized by
``gpu_memory_utilization``: with eager execution and ``kv_cache_memory_bytes`` vLLM 0.32 skips the
warm-up that allocates the stage's intermediate tensors, and the second stage fails).
"""

from __future__ import annotations

import os

import pytest

import kvedit
from kvedit.errors import ModelNotAvailableError

pytest.importorskip("vllm")
pytestmark = pytest.mark.real

TEXT = (
    "Alice's secret number is 4821. Bob's secret number is 7310. "
    "Carol's secret number is 5902. Dave's secret number is 1234."
)
SPAN = "Bob's secret number is 7310."
QUESTION = " Question: What is Bob's secret number? Answer:"
MAX_TOKENS = 12


@pytest.fixture
def two_workers(monkeypatch):
    """Bind each of the two workers' OpenMP threads to one CPU (vLLM's automatic binding wants
    one NUMA node per worker)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")


def _share_of_memory(nbytes: float) -> float:
    """``gpu_memory_utilization`` for ``nbytes`` per worker (on CPU: a share of all RAM)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(0.9, nbytes / total)


def _serve_and_compare(model, tok, root, scale: float, **llm_kwargs) -> None:
    from vllm import SamplingParams

    from kvedit.integrations.vllm import engine, publish

    state = kvedit.capture(model, tok, TEXT)
    edited = kvedit.ops.scale_keys(state, SPAN, scale)
    q = state.encode(QUESTION)
    llm = engine(model, root, distributed_executor_backend="mp", max_model_len=2048, **llm_kwargs)
    try:
        got = {}
        for name, st in [("plain", state), ("scale_keys", edited)]:  # same ids, two files
            ids = publish(st, root)
            extra = ids.sampling_extra_args()  # names the digest
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, extra_args=extra)
            out = llm.generate({"prompt_token_ids": ids + q}, params, use_tqdm=False)[0]
            want = st.answer(QUESTION, MAX_TOKENS).token_ids
            assert out.kv_transfer_params["kvedit"]["served"] == len(ids), name
            assert out.kv_transfer_params["kvedit"]["digest"] == ids.digest, name
            assert out.num_cached_tokens == len(ids), name
            assert list(out.outputs[0].token_ids[: len(want)]) == want, (name, out.outputs[0].text)
            got[name] = want
        assert got["scale_keys"] != got["plain"], "pick an edit that changes the answer"
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_tensor_parallel_2_serves_a_replicated_kv_head(two_workers, tmp_path):
    try:
        model, tok = kvedit.load_model("gemma3-270m", device="cpu")
    except ModelNotAvailableError as e:
        pytest.skip(str(e))
    assert model.config.num_key_value_heads == 1  # 1 KV head on 2 ranks: replicated
    _serve_and_compare(
        model, tok, tmp_path, 3.0, tensor_parallel_size=2, kv_cache_memory_bytes=256 << 20
    )


@pytest.mark.skipif(
    os.environ.get("KVEDIT_TEST_PIPELINE") != "1",
    reason="pipeline parallel on CPU takes ~2 min: make test-vllm-pipeline (KVEDIT_TEST_PIPELINE=1)",
)
def test_pipeline_parallel_2_serves_each_stage_its_layers(two_workers, smollm2, tmp_path):
    model, tok = smollm2
    _serve_and_compare(
        model,
        tok,
        tmp_path,
        0.5,
        pipeline_parallel_size=2,
        enforce_eager=False,  # the warm-up allocates the second stage's intermediate tensors
        gpu_memory_utilization=_share_of_memory(2.5 * 2**30),  # weights, activations, KV
    )
