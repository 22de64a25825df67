"""Tiled online-softmax (FlashAttention-style) forward with grouped KV heads and a key bias.

Layout. One program owns one key/value head ``hkv`` of one batch row and a tile of
``BLOCK_M`` *query rows*, where the ``G = H // Hkv`` query heads that share ``hkv`` are packed
into the row dimension: row ``r`` is query ``i = r // G`` of query head ``hkv * G + r % G``.
Each K/V tile is therefore loaded once for the whole group (decode, ``Sq == 1``, becomes one
``[G, D] x [D, BLOCK_N]`` product per tile instead of ``G`` matrix-vector products) and GQA
needs no ``repeat_kv``.

Masking is never materialised: query ``i`` sits at absolute position ``diag_offset + i`` and
sees key ``j`` iff ``j <= pos`` and ``pos - j < window`` (the wrapper encodes "not causal" and
"no window" as offsets/windows too large to matter). Per tile, the key range splits into
blocks that some row must mask (window edge, causal diagonal, ragged end) and blocks every
row sees whole; only the former pay for the mask.

Decode. With ``Sq * G <= 64`` rows a tile holds every query row of a KV head, so one program
per (batch row, KV head) covers the cache in one launch and writes the final output; this is
the path up to :data:`~kvedit.triton.configs.DECODE_SINGLE_PASS_MAX_KEYS` visible keys.

Split-K. Beyond that, when ``tiles x batch x kv heads`` is too small to fill the GPU, the key
range of every tile is divided among ``num_splits`` programs, which write normalised partial
outputs with their softmax statistics (running max ``m`` and denominator ``l``);
:func:`_combine_kernel` merges them. The statistics are kept apart rather than folded into a
log-sum-exp: with a huge finite bias such as ``-1e30``, ``m + log2(l)`` would round away ``l``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from kvedit.triton import configs as _configs
from kvedit.triton._common import KernelInputError, check_attention_inputs
from kvedit.triton.configs import DECODE_SINGLE_PASS_MAX_KEYS, KernelConfig
from kvedit.triton.counting import record
from kvedit.triton.reference import check_sinks

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32; full fp32 precision (no TF32) when ``IEEE``."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_blocks(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    bias_base,
    bias_rows,
    start,
    stop,
    pos,
    offs_n0,
    offs_d,
    stride_ks,
    stride_kd,
    stride_vs,
    stride_vd,
    stride_bs,
    Sk,
    window,
    D,
    qk_scale,
    MASKED: tl.constexpr,
    BIAS_MODE: tl.constexpr,
    EVEN_D: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Fold key blocks ``[start, stop)`` (``start`` a multiple of ``BLOCK_N``) into the state.

    State: ``acc [BLOCK_M, BLOCK_D]`` un-normalised output, ``l_i [BLOCK_M]`` softmax
    denominator, ``m_i [BLOCK_M]`` running max of the logits in log2 units (``-inf`` while a row
    has seen no visible key). ``MASKED`` blocks apply the causal/window/length mask;
    unmasked blocks must lie wholly inside every row's visible range.
    """
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + offs_n0
        k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
        if MASKED:
            kv_mask = offs_n[:, None] < Sk
            if not EVEN_D:
                kv_mask = kv_mask & (offs_d[None, :] < D)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            d_mask = offs_d[None, :] < D
            k = tl.load(k_ptrs, mask=d_mask, other=0.0)
            v = tl.load(v_ptrs, mask=d_mask, other=0.0)

        s = _dot(q, tl.trans(k), IEEE) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if BIAS_MODE == 1:  # one bias row per kv head, shared by the whole group
            b_ptrs = bias_base + offs_n * stride_bs
            if MASKED:  # noqa: SIM108 (constexpr branches read clearer in kernels)
                b = tl.load(b_ptrs, mask=offs_n < Sk, other=0.0)
            else:
                b = tl.load(b_ptrs)
            s += b.to(tl.float32)[None, :] * 1.4426950408889634
        elif BIAS_MODE == 2:  # one bias row per query head
            b_ptrs = bias_base + bias_rows[:, None] + offs_n[None, :] * stride_bs
            if MASKED:  # noqa: SIM108
                b = tl.load(b_ptrs, mask=offs_n[None, :] < Sk, other=0.0)
            else:
                b = tl.load(b_ptrs)
            s += b.to(tl.float32) * 1.4426950408889634
        if MASKED:
            visible = (
                (offs_n[None, :] <= pos[:, None])
                & ((pos[:, None] - offs_n[None, :]) < window)
                & (offs_n[None, :] < Sk)
            )
            s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key so far keeps m = -inf; subtract 0 instead to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["G", "Sq", "Sk", "diag_offset", "window", "D"])
def _attn_fwd_kernel(
    Q,
    K,
    V,
    Bias,
    Sinks,
    Out,
    Stats,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_bb,
    stride_bh,
    stride_bs,
    stride_ob,
    stride_oh,
    stride_osplit,
    stride_os,
    stride_od,
    stride_tb,
    stride_th,
    stride_tsplit,
    stride_ts,
    stride_tc,
    stride_sink,
    Hkv,
    G,
    Sq,
    Sk,
    diag_offset,
    window,
    D,
    qk_scale,
    BIAS_MODE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    WRITE_STATS: tl.constexpr,
    EVEN_D: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(row tiles, B * Hkv, num_splits)``; see the module docstring for the layout.

    Writes ``Out[b, h, split, i, :]`` (normalised by this split's denominator) and
    ``Stats[b, h, split, i, :] = (m, l)``: the max logit in log2 units (``-inf`` if the split
    saw no key) and the softmax denominator relative to it. Without split-K, ``Out`` is the
    final output, ``stride_osplit`` is 0 and ``WRITE_STATS`` is False (no ``Stats``).
    ``Sinks`` are in nats (converted to log2 units here, so the host does no work per call).
    """
    # Largest causal tiles first: they have the most key blocks.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    b = (pid_bh // Hkv).to(tl.int64)
    hkv = pid_bh % Hkv

    n_rows = Sq * G
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < n_rows
    i_row = offs_r // G
    h_row = (hkv * G + offs_r % G).to(tl.int64)
    pos = diag_offset + i_row
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = (
        Q
        + b * stride_qb
        + h_row[:, None] * stride_qh
        + i_row[:, None] * stride_qs
        + offs_d[None, :] * stride_qd
    )
    if EVEN_D:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)

    k_base = K + b * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = V + b * stride_vb + hkv.to(tl.int64) * stride_vh
    bias_rows = h_row * stride_bh  # used by BIAS_MODE == 2 only
    if BIAS_MODE == 1:
        bias_base = Bias + b * stride_bb + hkv.to(tl.int64) * stride_bh
    else:
        bias_base = Bias + b * stride_bb

    # Key range of this tile: [lo, hi) holds every key some row sees; [m1, m2) only keys that
    # every row sees (no mask needed). All bounds are clamped >= 0 before any division.
    r_first = pid_m * BLOCK_M
    r_last = tl.minimum(r_first + BLOCK_M, n_rows) - 1
    pos_first = diag_offset + r_first // G
    pos_last = diag_offset + r_last // G
    lo = tl.maximum(pos_first - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(tl.minimum(Sk, pos_last + 1), lo)
    full_lo = tl.maximum(pos_last - window + 1, 0)
    full_hi = tl.maximum(tl.minimum(Sk, pos_first + 1), 0)
    m1 = tl.minimum(tl.maximum(lo, (full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N), hi)
    m2 = tl.minimum(tl.maximum(m1, (full_hi // BLOCK_N) * BLOCK_N), hi)
    # This program's share of the tile's key blocks.
    n_blocks = (hi - lo + BLOCK_N - 1) // BLOCK_N
    per_split = (n_blocks + n_splits - 1) // n_splits * BLOCK_N
    s_lo = tl.minimum(lo + split * per_split, hi)
    s_hi = tl.minimum(s_lo + per_split, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # split 0 starts from the sink: a logit (log2 units) holding weight 1
        sink = tl.load(Sinks + h_row * stride_sink, mask=row_ok, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634
        first = split == 0
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Window edge (masked), interior (unmasked), causal diagonal and ragged end (masked).
    acc, l_i, m_i = _attend_blocks(
        acc, l_i, m_i, q, k_base, v_base, bias_base, bias_rows,
        s_lo, tl.minimum(m1, s_hi), pos, offs_n0, offs_d,
        stride_ks, stride_kd, stride_vs, stride_vd, stride_bs, Sk, window, D, qk_scale,
        True, BIAS_MODE, EVEN_D, IEEE, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _attend_blocks(
        acc, l_i, m_i, q, k_base, v_base, bias_base, bias_rows,
        tl.maximum(m1, s_lo), tl.minimum(m2, s_hi), pos, offs_n0, offs_d,
        stride_ks, stride_kd, stride_vs, stride_vd, stride_bs, Sk, window, D, qk_scale,
        False, BIAS_MODE, EVEN_D, IEEE, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _attend_blocks(
        acc, l_i, m_i, q, k_base, v_base, bias_base, bias_rows,
        tl.maximum(m2, s_lo), s_hi, pos, offs_n0, offs_d,
        stride_ks, stride_kd, stride_vs, stride_vd, stride_bs, Sk, window, D, qk_scale,
        True, BIAS_MODE, EVEN_D, IEEE, BLOCK_N,
    )  # fmt: skip

    # Rows that saw no visible key (everything masked) output 0 (and report l = 0).
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]

    o_ptrs = (
        Out
        + b * stride_ob
        + h_row[:, None] * stride_oh
        + split * stride_osplit
        + i_row[:, None] * stride_os
        + offs_d[None, :] * stride_od
    )
    if EVEN_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))
    if WRITE_STATS:
        t_ptrs = (
            Stats + b * stride_tb + h_row * stride_th + split * stride_tsplit + i_row * stride_ts
        )
        tl.store(t_ptrs, m_i, mask=row_ok)
        tl.store(t_ptrs + stride_tc, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["n_splits", "D"])
def _combine_kernel(
    Part,
    Stats,
    Out,
    stride_pb,
    stride_ph,
    stride_psplit,
    stride_ps,
    stride_pd,
    stride_tb,
    stride_th,
    stride_tsplit,
    stride_ts,
    stride_tc,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    H,
    n_splits,
    D,
    BLOCK_SPLIT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge split-K partials: grid ``(Sq, B * H)``, one output row per program.

    ``Part [B, H, n_splits, Sq, D]`` fp32 normalised partial outputs and
    ``Stats [B, H, n_splits, Sq, 2]`` their ``(m, l)``; writes ``Out [B, H, Sq, D]``.
    """
    i = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_SPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    d_ok = offs_d < D

    t_ptrs = Stats + b * stride_tb + h * stride_th + offs_s * stride_tsplit + i * stride_ts
    m = tl.load(t_ptrs, mask=s_ok, other=float("-inf"))
    l_s = tl.load(t_ptrs + stride_tc, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = l_s * tl.exp2(m - m_safe)  # 0 for splits that saw no key
    denom = tl.sum(w, 0)
    part = tl.load(
        Part
        + b * stride_pb
        + h * stride_ph
        + offs_s[:, None] * stride_psplit
        + i * stride_ps
        + offs_d[None, :] * stride_pd,
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + i * stride_os + offs_d * stride_od,
        out.to(Out.dtype.element_ty),
        mask=d_ok,
    )


# Read once at import (the kernels' type says whether Triton interprets them).
_KERNEL_TYPE = type(_attn_fwd_kernel).__name__
_TL_TYPE = type(tl.zeros).__name__


def kernels_interpreted() -> bool:
    """Whether the kernels were defined under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter).

    Raises:
        RuntimeError: the kernels are interpreted but ``triton.language`` was imported before
            ``TRITON_INTERPRET=1`` was set, a mix the interpreter cannot run.
    """
    interpreted = _KERNEL_TYPE == "InterpretedFunction"
    if interpreted and _TL_TYPE != "InterpretedFunction":
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton.language had been imported (importing "
            "kvedit or transformers imports it); set it before importing them"
        )
    return interpreted


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device`` (cached), None off CUDA or interpreted."""
    if device.type != "cuda" or kernels_interpreted():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = tuple(torch.cuda.get_device_capability(index))
    return _CAPABILITY[index]


def _candidate_configs(
    rows: int, block_d: int, dtype: torch.dtype, device: torch.device | None = None
) -> list[KernelConfig]:
    """Launch configs to try in order; later ones need less shared memory and registers.

    ``rows`` is ``Sq * G`` (query rows per kv head). The first comes from
    :mod:`kvedit.triton.configs` (the table for this GPU and head dim, else the default); with
    64 rows or fewer (decode, short chunks) the tile is just tall enough for them.
    """
    if kernels_interpreted():  # a fixed small config; speed here is the interpreter's
        return [KernelConfig(block_m=min(32, _pow2_at_least(rows)), block_n=32)]
    capability = None if device is None else _capability(device)
    return _configs.fallbacks(_configs.pick_config(rows, block_d, dtype, capability))


_SM_COUNT: dict[int, int] = {}
_CAPABILITY: dict[int, tuple[int, int]] = {}
# (rows bucket, block_d, dtype, device) -> the candidate configs, and the index of the first one
# that compiled (the config is chosen once per bucket, never per call).
_CANDIDATES: dict[tuple, list[KernelConfig]] = {}
_WORKING_CONFIG: dict[tuple, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _default_num_splits(
    programs: int, key_blocks: int, device: torch.device, visible_keys: int | None = None
) -> int:
    """Split the key range when the grid alone would leave most of the GPU idle (decode).

    Never below :data:`~kvedit.triton.configs.DECODE_SINGLE_PASS_MAX_KEYS` visible keys (one
    launch, no combine). Otherwise aims at about two programs per multiprocessor with at least
    4 key blocks per split. Depends on shapes only (never on values): no host sync, and a
    captured CUDA graph stays valid for the shapes it was captured with.
    """
    if device.type != "cuda" or kernels_interpreted():
        return 1
    if visible_keys is not None and visible_keys <= DECODE_SINGLE_PASS_MAX_KEYS:
        return 1
    sms = _sm_count(device)
    if programs >= sms:
        return 1
    return max(1, min(math.ceil(2 * sms / programs), key_blocks // 4, 128))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention forward with grouped KV heads and an additive per-key bias (Triton).

    Same contract as :func:`kvedit.triton.reference.attention_reference`; ``num_splits``
    (split-K factor, default: 1 up to ``DECODE_SINGLE_PASS_MAX_KEYS`` visible keys, else chosen
    from the GPU's size) and ``config`` (launch config, default from
    :mod:`kvedit.triton.configs`, falling back to smaller ones if a config does not fit the GPU)
    are for tests and benchmarks.

    Per call on CUDA: one kernel launch (two with split-K), one output allocation (plus the
    split-K workspace), no host-device synchronisation, and launch decisions that depend only on
    shapes, so the call can be captured in a CUDA graph.

    Returns:
        ``[B, H, Sq, D]`` in ``q.dtype``. Forward only: no autograd graph is recorded.
    """
    shape = check_attention_inputs(q, k, v, bias, causal, window)
    check_sinks(sinks, q)
    B, H, Hkv, G = shape.batch, shape.heads, shape.kv_heads, shape.group
    Sq, Sk, D = shape.q_len, shape.k_len, shape.head_dim
    interpreted = kernels_interpreted()
    if q.device.type != "cuda" and not interpreted:
        raise KernelInputError(
            f"the Triton attention kernel needs CUDA tensors, got {q.device}; to run it on CPU set "
            "TRITON_INTERPRET=1 before kvedit.triton's kernels are first used"
        )
    if num_splits is not None and num_splits < 1:
        raise KernelInputError(f"num_splits must be >= 1, got {num_splits}")
    out_dtype = q.dtype
    scale = D**-0.5 if scale is None else float(scale)
    if B == 0 or H == 0 or Sq == 0:
        return torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if Sk == 0:
        return torch.zeros(q.shape, dtype=out_dtype, device=q.device)
    # Sinks stay in nats (the kernel converts them); a dummy pointer without them.
    sinks_arg, sink_stride = (q, 0) if sinks is None else (sinks, sinks.stride(0))

    if interpreted and q.dtype != torch.float32:
        # The interpreter mishandles bf16 in tl.dot (triton#11584); run it in fp32 there.
        q, k, v = q.float(), k.float(), v.float()
        if bias is not None:
            bias = bias.float()
        if sinks is not None:
            sinks_arg = sinks.float()

    # Query i sits at absolute position Sk - Sq + i; without causal, "after" every key.
    diag_offset = Sk - Sq if causal else Sk
    window_arg = window if window is not None else Sk + Sq + 1  # never binding

    if bias is None:
        bias_mode, bias_arg, bias_strides = 0, q, (0, 0, 0)
    else:
        bias_mode = 2 if shape.bias_per_query_head else 1
        bias_arg, bias_strides = bias, bias.stride()

    rows = Sq * G
    block_d = _pow2_at_least(D)
    cache_key = (_pow2_at_least(rows) if rows <= 64 else 65, block_d, q.dtype, q.device)
    if config is not None:
        configs, first = [config], 0
    else:
        configs = _CANDIDATES.get(cache_key)
        if configs is None:
            configs = _CANDIDATES[cache_key] = _candidate_configs(rows, block_d, q.dtype, q.device)
        first = _WORKING_CONFIG.get(cache_key, 0)
    # Keys some query sees: the whole cache, or the window (plus the queries' own span).
    visible_keys = min(Sk, window_arg + Sq - 1)

    out = torch.empty((B, H, Sq, D), dtype=out_dtype, device=q.device)
    last_error: Exception | None = None
    for index in range(first, len(configs)):
        cfg = configs[index]
        row_tiles = triton.cdiv(rows, cfg.block_m)
        key_blocks = triton.cdiv(min(Sk, window_arg + cfg.block_m), cfg.block_n)
        splits = num_splits or _default_num_splits(
            row_tiles * B * Hkv, key_blocks, q.device, visible_keys
        )
        if splits == 1:
            part = out if out.dtype == q.dtype else torch.empty_like(q)
            part_strides = (part.stride(0), part.stride(1), 0, part.stride(2), part.stride(3))
            stats, stats_strides = part, (0, 0, 0, 0, 0)  # not written
        else:  # one workspace: fp32 partial outputs, then their (m, l) statistics
            n_part = B * H * splits * Sq * D
            work = torch.empty(
                n_part + B * H * splits * Sq * 2, dtype=torch.float32, device=q.device
            )
            part = work[:n_part].view(B, H, splits, Sq, D)
            stats = work[n_part:].view(B, H, splits, Sq, 2)
            part_strides, stats_strides = part.stride(), stats.stride()
        try:
            _attn_fwd_kernel[(row_tiles, B * Hkv, splits)](
                q, k, v, bias_arg, sinks_arg, part, stats,
                *q.stride(), *k.stride(), *v.stride(), *bias_strides,
                *part_strides, *stats_strides, sink_stride,
                Hkv, G, Sq, Sk, diag_offset, window_arg, D, scale * LOG2E,
                BIAS_MODE=bias_mode,
                HAS_SINKS=sinks is not None,
                WRITE_STATS=splits > 1,
                EVEN_D=block_d == D,
                IEEE=q.dtype == torch.float32,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_D=block_d,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )  # fmt: skip
        except OutOfResources as error:  # config too big for this GPU: try the next one
            last_error = error
            continue
        record("attention")
        if config is None and index != first:
            _WORKING_CONFIG[cache_key] = index
        if splits > 1:
            record("attention_combine")
            _combine_kernel[(Sq, B * H)](
                part, stats, out,
                *part.stride(), *stats.stride(), *out.stride(),
                H, splits, D,
                BLOCK_SPLIT=triton.next_power_of_2(splits),
                BLOCK_D=block_d,
            )  # fmt: skip
        elif part is not out:
            out.copy_(part)
        return out
    raise RuntimeError(f"no attention launch config fits this GPU: {last_error}")
