"""Decode through the Triton kernel: launches, host syncs and device work per step.

Without a GPU the kernel runs in Triton's interpreter; what is counted here (kernel launches,
torch ops and host-device syncs on the attention path) is the same on CUDA, so a regression
(a second launch, a per-step cast, an ``.item()``) fails here first. The CUDA-graph test runs
only with CUDA.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvedit.triton as kt
from kvedit.triton.counting import LAUNCHES, count_launches

pytestmark = pytest.mark.skipif(
    not kt.is_available(), reason="Triton missing, or neither CUDA nor TRITON_INTERPRET=1"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Ops that make the host wait for the device (item/bool/int of a tensor, data-dependent shapes).
SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "nonzero",
    "equal",
    "unique",
    "masked_select",
}
# Ops that neither launch device work nor sync: allocation and views.
FREE_OPS = {
    "empty", "empty_strided", "empty_like", "view", "_unsafe_view", "expand", "slice", "select",
    "as_strided", "transpose", "t", "permute", "unsqueeze", "squeeze", "alias", "detach",
    "_reshape_alias", "unflatten", "lift_fresh", "split", "split_with_sizes", "unbind",
}  # fmt: skip


def _impl():
    from kvedit.triton import _attention

    return _attention


class OpLog(TorchDispatchMode):
    """Records aten ops by name, except while a Triton kernel runs (the interpreter's own
    tensor traffic is not the host's work per step)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def syncs(self) -> int:
        return sum(n for op, n in self.ops.items() if op in SYNC_OPS)

    def device_ops(self) -> dict[str, int]:
        return {op: n for op, n in self.ops.items() if op not in FREE_OPS | SYNC_OPS}


@contextlib.contextmanager
def kernels_paused(monkeypatch, log: OpLog):
    """Wrap the attention kernels so that ``log`` skips their interpreted bodies."""
    impl = _impl()

    class Paused:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                log.paused += 1
                try:
                    return launch(*args, **kwargs)
                finally:
                    log.paused -= 1

            return run

    monkeypatch.setattr(impl, "_attn_fwd_kernel", Paused(impl._attn_fwd_kernel))
    monkeypatch.setattr(impl, "_combine_kernel", Paused(impl._combine_kernel))
    yield


def _decode_inputs(B=1, Hkv=2, G=4, Sk=40, D=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, 1, D, generator=gen).to(DEVICE)
    k = torch.randn(B, Hkv, Sk, D, generator=gen).to(DEVICE)
    v = torch.randn(B, Hkv, Sk, D, generator=gen).to(DEVICE)
    bias = torch.randn(B, 1, Sk, generator=gen).to(DEVICE)
    return q, k, v, bias


@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_call_is_one_launch_no_sync_no_other_device_work(monkeypatch, with_sinks) -> None:
    """``attend`` on one biased query: one kernel launch, one allocation (the output), no torch
    kernel (no cast, no bias expansion, no sink conversion) and no host sync."""
    from kvedit.attention import attend

    monkeypatch.setenv("KVEDIT_ATTENTION", "triton")
    q, k, v, bias = _decode_inputs()
    sinks = torch.randn(q.shape[1], device=DEVICE).to(torch.bfloat16) if with_sinks else None
    log = OpLog()
    with kernels_paused(monkeypatch, log), count_launches() as launched, log:
        out = attend(q, k, v, bias=bias, window=30, sinks=sinks)
    assert dict(launched) == {"attention": 1}
    assert log.syncs() == 0, log.ops
    assert log.device_ops() == {}, log.ops
    ref = kt.attention_reference(q, k, v, bias.expand(1, 2, -1), window=30, sinks=sinks)
    assert (out - ref).abs().max().item() < 1e-4


def test_split_k_is_two_launches() -> None:
    q, k, v, bias = _decode_inputs(Sk=70)
    with count_launches() as launched:
        _impl().attention(q, k, v, bias.expand(1, 2, -1), num_splits=3)
    assert dict(launched) == {"attention": 1, "attention_combine": 1}


def test_single_pass_below_the_threshold(monkeypatch) -> None:
    """On a GPU the split factor depends on the visible key count and the shapes only: one pass
    (no combine) up to DECODE_SINGLE_PASS_MAX_KEYS, split-K beyond when the grid is small."""
    impl = _impl()
    monkeypatch.setattr(impl, "kernels_interpreted", lambda: False)
    monkeypatch.setattr(impl, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    limit = impl.DECODE_SINGLE_PASS_MAX_KEYS
    blocks = lambda n: n // 64  # noqa: E731
    assert impl._default_num_splits(8, blocks(1024), cuda, 1024) == 1
    assert impl._default_num_splits(8, blocks(limit), cuda, limit) == 1
    assert impl._default_num_splits(8, blocks(32768), cuda, 32768) > 1
    assert impl._default_num_splits(256, blocks(32768), cuda, 32768) == 1  # grid already full


def test_steered_generate_launches_one_kernel_per_layer_per_step(monkeypatch, llama) -> None:
    """A steered ``generate`` of a tiny Llama through the Triton path: every decode step runs
    the kernel once per layer (a silent fall-back to SDPA would give 0) and the attention
    dispatch itself adds no host sync."""
    import kvedit
    import kvedit.attention as ka

    model, tok = llama
    model = model.to(DEVICE)
    monkeypatch.setenv("KVEDIT_ATTENTION", "triton")
    n_layers = model.config.num_hidden_layers
    per_step: list[int] = []
    attn_log = OpLog()
    real = ka._attend_triton

    def logged(*args, **kwargs):
        with attn_log:
            return real(*args, **kwargs)

    monkeypatch.setattr(ka, "_attend_triton", logged)
    launches_before: list[int] = []

    def pre_hook(module, args, kwargs):
        launches_before.append(LAUNCHES["attention"])

    def post_hook(module, args, kwargs, output):
        per_step.append(LAUNCHES["attention"] - launches_before[-1])

    h1 = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    h2 = model.register_forward_hook(post_hook, with_kwargs=True)
    prompt = "Alice's secret number is 4821. Bob's secret number is 7310. Question: Alice?"
    ids = tok(prompt, return_tensors="pt").to(DEVICE)
    try:
        with kernels_paused(monkeypatch, attn_log), kvedit.steer(model, tok, emphasize="4821"):
            model.generate(**ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    finally:
        h1.remove()
        h2.remove()
    assert len(per_step) >= 3, per_step  # (steer may run forwards of its own first)
    assert per_step[-2:] == [n_layers, n_layers], per_step  # the 2 decode steps
    assert attn_log.syncs() == 0, attn_log.ops


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("k_len", [1000, 5000])
def test_decode_captures_in_a_cuda_graph(k_len: int) -> None:
    """The decode call (single pass and split-K) replays from a CUDA graph with new inputs."""
    q, k, v, bias = (t.to(torch.bfloat16) for t in _decode_inputs(Hkv=8, Sk=k_len, D=128))
    bias = bias.float().expand(1, 8, -1)
    kt.attention(q, k, v, bias)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kt.attention(q, k, v, bias)
    for seed in (1, 2):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q))
        graph.replay()
        torch.cuda.synchronize()
        expected = kt.attention(q, k, v, bias)
        assert torch.equal(out, expected)
