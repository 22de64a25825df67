"""``kvedit.steer``: move a model's attention onto (or off) chosen spans of its prompt.

Strength is in nats, added to the attention logits of every emphasized key (subtracted for
suppressed keys). A bias of ``s`` multiplies a key's unnormalised attention weight by ``e**s``:

* **PASTA's α.** PASTA scales the attention to the *other* tokens by ``α`` and renormalises;
  that is the same distribution as adding ``ln(1/α)`` to the emphasized ones, so
  ``strength = -ln(α)`` (α = 0.01 is 4.6 nats).
* **A target share.** A span holding a share ``p`` of a query's attention gets
  ``p' = p·e^s / (p·e^s + 1 − p)``; :func:`strength_for_share` inverts this.

Usage::

    with kvedit.steer(model, tok, emphasize="Alice's secret number is 4821.") as s:
        out = model.generate(**inputs)            # spans found in the decoded input ids

    s = kvedit.steer(model, tok, emphasize=["Alice"], strength=2.0)
    s.generate(prompt)                            # spans refer to ``prompt``
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from . import checks
from .capturing import capture_tokens
from .errors import EmptySelectionError, InvalidInputError, InvalidTypeError
from .focusing import ABSTAIN_THRESHOLD, Focus, content_question
from .focusing import focus as run_focus
from .passages import template_ranges
from .runtime import activate, detached
from .spans import Spans, as_span_list, char_ranges, token_offsets, tokens_in_ranges
from .strengths import strength_for_share, strength_from_pasta_alpha

__all__ = [
    "SCOPES",
    "SpanPlan",
    "SteerConfig",
    "Steering",
    "steer",
    "strength_for_share",
    "strength_from_pasta_alpha",
]

SCOPES = ("all", "decode")


@dataclass(frozen=True)
class FocusRequest:
    """``steer(focus=True)``: the question :func:`kvedit.focus` is asked at each prompt, and
    how its passages are cut (``passages`` as :func:`kvedit.focus` takes them)."""

    question: str
    passages: object = None
    top_k: int = 1
    guard: object = None  # a kvedit.guard.Guard, or None
    threshold: float | None = ABSTAIN_THRESHOLD


@dataclass(frozen=True)
class SteerConfig:
    """What to steer and how. See :func:`steer`."""

    emphasize: tuple
    suppress: tuple
    strength: float
    layers: tuple[int, ...] | None
    heads: Mapping[int, tuple[int, ...]] | None
    scope: str
    protect_special: bool
    focus: FocusRequest | None = None


class SpanPlan:
    """A :class:`~kvedit.attention.BiasPlan` that biases the keys of span tokens of the prompt.

    ``token_bias`` ``[batch, prompt_len]`` holds the bias per absolute token index; keys past
    the prompt (generated tokens) get none.
    """

    def __init__(
        self, config: SteerConfig, tokenizer, n_layers: int, n_heads: int, model=None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model = model  # needed by focus, which reads the prompt's cache to bind
        # focus: the bias of each layer; token_bias then holds 1.0 on the chosen tokens
        self.layer_strengths: torch.Tensor | None = None
        self.found = None  # focus: the kvedit.focus.Focus of the latest bound prompt
        # scope "decode": the first query (absolute index) the bias applies to; default the
        # prompt's last token. Focus sets the last token before the question (the cache edit
        # recomputes it, and the question is read over the edited cache).
        self.first_biased: int | None = None
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.token_bias: torch.Tensor | None = None
        self.fixed = False  # True when bound from a prompt text (wrapper mode)
        self.bound_ids: torch.Tensor | None = None  # the input ids the spans were bound to
        # Absolute length of the sequence in the current forward (cached + new tokens), set by
        # the forward pre-hook. Sliding-window layers hold only their last tokens, so the
        # attention's own key count cannot tell which tokens its keys are.
        self.seq_len: int | None = None
        self._memo_key: tuple[int, int] | None = None  # (k_len, total_len) of the cached bias
        self._memo: torch.Tensor | None = None

    # -- binding spans to tokens -----------------------------------------------------------

    def bind_text(self, text: str, offsets: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
        """Bias per token ``[n_tokens]`` for one sequence, from its text and token offsets."""
        cfg = self.config
        if cfg.focus is not None:
            return self._focus_bias(text, offsets, ids)
        bias = torch.zeros(len(ids), dtype=torch.float32)
        emph = (
            tokens_in_ranges(offsets, char_ranges(text, cfg.emphasize)) if cfg.emphasize else None
        )
        supp = tokens_in_ranges(offsets, char_ranges(text, cfg.suppress)) if cfg.suppress else None
        if emph is not None and supp is not None:
            both = set(emph.tolist()) & set(supp.tolist())
            if both:
                shown = self.tokenizer.convert_ids_to_tokens([int(ids[i]) for i in sorted(both)])
                raise InvalidInputError(
                    f"emphasize and suppress spans overlap on tokens {shown[:10]}; a token "
                    "cannot be both"
                )
        if emph is not None:
            bias[emph] = cfg.strength
        if supp is not None:
            bias[supp] = -cfg.strength
        if cfg.protect_special:
            special = set(self.tokenizer.all_special_ids)
            for i, tid in enumerate(ids):
                if int(tid) in special:
                    bias[i] = 0.0
            bias[0] = 0.0  # the attention sink
        return bias

    def _focus_bias(self, text: str, offsets: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
        """Run :func:`kvedit.focus` on the prompt up to its question's line: ``1.0`` on the
        chosen passages' tokens, the layer strengths in :attr:`layer_strengths`, and the bias
        applies from the last token before the cut on (:attr:`first_biased`), so the answer
        equals :meth:`kvedit.focus.Focus.generate` on the same cut (the cache edit).

        The cut is where the question's line starts, less the whitespace before it (for the
        evaluation suite's prompt, ``context + "\n\nQuestion: " + question``, the cut of
        :func:`kvedit.focus_text`). Passages come from the turn that asks (after the last
        chat-template line before the cut), never from the template's own lines such as a
        system prompt, so ``steer(focus=True)`` and :func:`kvedit.focus_text` choose among the
        same passages. A prompt with no passage there gets no edit (``plan.found.chosen`` is
        empty, ``plan.found.reason`` says why). ``protect_special`` does not apply (focus
        passages never hold template tokens, and the cache edit protects none)."""
        request = self.config.focus
        if self.model is None:
            raise InvalidInputError("steer(focus=True) needs the model to read the prompt")
        asked = text.rfind(request.question)
        if asked < 0:
            raise InvalidInputError(
                f"steer(focus=True): the question {request.question!r} is not in the prompt"
            )
        line = text.rfind("\n", 0, asked) + 1  # the question's line starts here
        cut = len(text[:line].rstrip())
        ends = offsets[:, 1].tolist()
        # the tokens before the cut: up to the first one that reaches past it
        n_prefix = next((i for i, end in enumerate(ends) if end > cut), len(ends)) if cut else 0
        if n_prefix == 0:
            raise InvalidInputError(
                "steer(focus=True): the prompt has no context before its question"
            )
        ids = [int(t) for t in ids]
        tok, model = self.tokenizer, self.model
        with detached(model):
            state = capture_tokens(model, tok, ids[:n_prefix])
            continuation = tok.decode(ids[n_prefix:], skip_special_tokens=False)
            if state.encode(continuation) != ids[n_prefix:]:
                raise InvalidInputError(
                    "steer(focus=True): the prompt's question part does not tokenize back to "
                    "the same ids; capture the context and call kvedit.focus instead"
                )
            template = [b for a, b in template_ranges(state.text, tok) if b <= len(state.text)]
            region = (max(template, default=0), len(state.text))  # the asking turn only
            try:
                found = run_focus(
                    state,
                    continuation,
                    request.passages,
                    top_k=request.top_k,
                    query=request.question,
                    region=region,
                    threshold=request.threshold,
                    guard=request.guard,
                )
            except EmptySelectionError:  # no passage in the asking turn: nothing to edit
                found = Focus(
                    state,
                    [],
                    [],
                    [],
                    [0.0] * len(state.layers),
                    continuation,
                    reason="no candidate passage before the question in its turn",
                )
        self.found = found
        self.first_biased = n_prefix - 1
        bias = torch.zeros(len(ids), dtype=torch.float32)
        self.layer_strengths = torch.tensor(found.strengths, dtype=torch.float32)
        if found.kept:  # a guard that dropped the edit leaves the prompt unsteered
            for i in found.chosen:
                bias[state.token_indices(found.passages[i])] = 1.0
        return bias

    def bind_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Find the spans in the decoded ``input_ids [batch, seq]`` (left padding skipped)."""
        B, T = input_ids.shape
        if self.config.focus is not None and B != 1:
            raise InvalidInputError(f"steer(focus=True) binds one prompt at a time, not {B}")
        token_bias = torch.zeros(B, T, dtype=torch.float32)
        for b in range(B):
            keep = (
                attention_mask[b].bool().cpu()
                if attention_mask is not None
                else torch.ones(T, dtype=torch.bool)
            )
            where = keep.nonzero().flatten()
            ids = input_ids[b, where].tolist()
            text, offsets = token_offsets(self.tokenizer, ids)
            token_bias[b, where] = self.bind_text(text, offsets, ids)
        self.token_bias = token_bias.to(input_ids.device)
        self.bound_ids = input_ids.detach().clone()
        self._memo_key = None

    def before_forward(self, model, args, kwargs) -> None:
        """The runtime's forward pre-hook: record the sequence length; bind spans to a new prompt."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            self.seq_len = None
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        self.seq_len = int(past) + input_ids.shape[1]
        if self.fixed:
            return
        # generate(use_cache=False) re-runs the bound prompt plus the tokens generated so far
        rerun = kwargs.get("use_cache") is False and self.continues(input_ids)
        if (past == 0 and not rerun) or self.token_bias is None:
            self.bind_ids(input_ids, kwargs.get("attention_mask"))

    def continues(self, input_ids: torch.Tensor) -> bool:
        """Whether ``input_ids`` is the bound prompt followed by more tokens."""
        bound = self.bound_ids
        return (
            bound is not None
            and input_ids.shape[0] == bound.shape[0]
            and input_ids.shape[1] > bound.shape[1]
            and torch.equal(input_ids[:, : bound.shape[1]].to(bound.device), bound)
        )

    # -- the BiasPlan protocol -------------------------------------------------------------

    def _layer_heads(self, layer_idx: int) -> tuple[int, ...] | None | bool:
        cfg = self.config
        if cfg.heads is not None:
            return cfg.heads.get(layer_idx, False) or False
        if cfg.layers is not None and layer_idx not in cfg.layers:
            return False
        return None  # every head

    def key_bias(self, layer_idx: int, k_len: int, total_len: int) -> torch.Tensor | None:
        if self.token_bias is None:
            return None
        total_len = self.seq_len if self.seq_len is not None else total_len
        heads = self._layer_heads(layer_idx)
        if heads is False:
            return None
        key = (k_len, total_len)
        if self._memo_key != key:  # the same for every layer of one forward: build it once
            tb = self.token_bias
            B, T = tb.shape
            first = total_len - k_len  # absolute index of key entry 0
            bias = tb.new_zeros(B, k_len)
            lo, hi = max(first, 0), min(T, total_len)
            if hi > lo:
                bias[:, lo - first : hi - first] = tb[:, lo:hi]
            self._memo_key, self._memo = key, bias
        bias = self._memo
        if self.layer_strengths is not None:
            bias = bias * float(self.layer_strengths[layer_idx])
        B = bias.shape[0]
        if heads is None:
            return bias[:, None, :]
        per_head = bias.new_zeros(B, self.n_heads, k_len)
        per_head[:, list(heads)] = bias[:, None, :]
        return per_head

    def unbiased_queries(self, q_len: int, total_len: int) -> int:
        if self.config.scope == "all" or self.token_bias is None:
            return 0
        total_len = self.seq_len if self.seq_len is not None else total_len
        # The prompt's own pass is unbiased, except its last query: it predicts the first
        # generated token (as after a cache edit, which recomputes the last token).
        first = self.token_bias.shape[1] - 1 if self.first_biased is None else self.first_biased
        return max(0, min(q_len, first - (total_len - q_len)))


class Steering:
    """A steering handle: a context manager around ``model.generate``, or a wrapper.

    Create it with :func:`steer`. Plans are scoped to the context that entered the block: a
    thread started inside it is not steered unless it runs through :meth:`thread` (which
    carries the context, e.g. for ``TextIteratorStreamer``); each thread's spans stay its own.
    The handle may re-enter itself (``with s: s.generate(p)``); another steering of the same
    model inside the block raises :class:`~kvedit.errors.NestedSteeringError`.
    """

    def __init__(self, model: PreTrainedModel, tokenizer, config: SteerConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        text_cfg = model.config.get_text_config()
        self._n_layers = text_cfg.num_hidden_layers
        self._n_heads = text_cfg.num_attention_heads
        self._local = threading.local()  # per thread: the ExitStack and plan of ``with``

    @property
    def plan(self) -> SpanPlan | None:
        """The plan of this thread's latest ``with`` block or :meth:`generate` call (its bound
        spans; with focus, ``plan.found``), if any."""
        return getattr(self._local, "plan", None)

    def _new_plan(self) -> SpanPlan:
        return SpanPlan(self.config, self.tokenizer, self._n_layers, self._n_heads, self.model)

    def __enter__(self) -> Steering:
        stacks = getattr(self._local, "stacks", None)
        if stacks is None:
            stacks = self._local.stacks = []
        stack = contextlib.ExitStack()
        plan = stack.enter_context(activate(self.model, self._new_plan(), owner=self))
        stacks.append(stack)
        self._local.plan = plan
        return self

    def __exit__(self, *exc) -> None:
        stacks = getattr(self._local, "stacks", None)
        if stacks:  # the plan stays readable: what the block's spans bound to
            stacks.pop().close()

    def thread(self, target, *args, **kwargs) -> threading.Thread:
        """A (not yet started) thread running ``target(*args, **kwargs)`` under this context's
        plans, so a generation in it is steered as in the ``with`` block that created it::

            with kvedit.steer(model, tok, emphasize=span) as s:
                t = s.thread(model.generate, **inputs, streamer=streamer)
                t.start()
                for piece in streamer: ...
                t.join()
        """
        context = contextvars.copy_context()
        return threading.Thread(target=context.run, args=(target, *args), kwargs=kwargs)

    @torch.no_grad()
    def generate(self, prompt: str, **gen_kwargs) -> str:
        """Tokenize ``prompt``, generate with steering, return only the new text.

        Spans refer to ``prompt``. Greedy and ``max_new_tokens=32`` by default; other keyword
        arguments go to ``model.generate``. Special tokens are skipped in the output.

        Raises:
            InvalidTypeError: ``prompt`` is not one str (None, bytes, a list of prompts: one
                prompt per call), or ``max_new_tokens`` is not an int.
            InvalidInputError: ``prompt`` is empty, ``max_new_tokens`` is below 1, or the
                prompt and ``max_new_tokens`` do not fit the model's maximum positions.
        """
        prompt = checks.text("prompt", prompt, allow_empty=False)
        if "max_new_tokens" in gen_kwargs:
            gen_kwargs["max_new_tokens"] = checks.count(
                "max_new_tokens", gen_kwargs["max_new_tokens"], minimum=1
            )
        new_tokens = gen_kwargs.get("max_new_tokens", 32)
        checks.context_fits(self.model, n_chars=len(prompt), reserve=new_tokens, what="prompt")
        tok = self.tokenizer
        enc = tok(prompt, return_offsets_mapping=True, return_tensors="pt")
        ids = enc["input_ids"]
        checks.context_fits(self.model, n_tokens=ids.shape[1], reserve=new_tokens, what="prompt")
        plan = self._new_plan()
        bias = plan.bind_text(prompt, enc["offset_mapping"][0], ids[0].tolist())
        plan.token_bias = bias[None].to(self.model.device)
        plan.fixed = True
        self._local.plan = plan  # readable afterwards, e.g. ``plan.found`` with focus
        gen_kwargs.setdefault("max_new_tokens", 32)
        gen_kwargs.setdefault("do_sample", False)
        if tok.pad_token_id is None:
            gen_kwargs.setdefault("pad_token_id", tok.eos_token_id)
        device = next(self.model.parameters()).device
        with activate(self.model, plan, owner=self):
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=enc["attention_mask"].to(device),
                **gen_kwargs,
            )
        return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def steer(
    model: PreTrainedModel,
    tokenizer,
    emphasize: Spans = (),
    suppress: Spans = (),
    strength: float = 2.0,
    layers: Sequence[int] | None = None,
    heads: Mapping[int, Sequence[int]] | None = None,
    scope: str | None = None,
    protect_special: bool = True,
    *,
    focus: bool = False,
    question: str | None = None,
    passages=None,
    top_k: int = 1,
    guard=None,
    threshold: float | None = ABSTAIN_THRESHOLD,
) -> Steering:
    """Steer ``model``'s attention toward ``emphasize`` and away from ``suppress``.

    Args:
        model, tokenizer: a Hugging Face causal LM and its tokenizer.
        emphasize, suppress: spans (substring, compiled regex or ``(start, end)``; one or a list).
            In wrapper mode they refer to the prompt text; as a context manager they are found
            in the decoded input ids of each ``generate`` call.
        strength: nats added to emphasized keys' logits and subtracted from suppressed ones.
        layers: layer indices to steer (default all).
        heads: ``{layer: [query head, ...]}``; when given only those heads are steered (on the
            layers of ``layers`` too, when both are given).
        scope: ``"all"`` (the default without ``focus``) also steers the prompt's own pass (as
            PASTA does); ``"decode"`` only the queries that predict new tokens (the prompt's
            last token and the generated ones), which is what the cache edits of
            :mod:`kvedit.ops` do.
        protect_special: never bias special tokens (BOS, chat-template markers) or token 0,
            the attention sink.
        focus: choose the spans automatically: at each prompt, :func:`kvedit.focus` reads the
            prompt's cache up to the line of ``question`` (its last occurrence; passages from
            the lines of the same turn before it, never the chat template's own lines such
            as a system prompt) and the chosen passages get its per-layer bias, in scope
            ``"decode"``, from the last token before that line on. When no passage stands
            out (or there is none), nothing is steered (``plan.found.chosen`` is empty).
            The answer is the one :meth:`kvedit.focus.Focus.generate` gives on that cut. Not
            combined with ``emphasize``/``suppress``/``layers``/``heads``; one prompt at a
            time. ``plan.found`` holds the latest :class:`~kvedit.focus.Focus`.
        question: with ``focus``, the question's text as it appears in the prompt.
        passages, top_k, guard, threshold: with ``focus``, as :func:`kvedit.focus` takes them
            (a guard that drops the edit, or a threshold no passage reaches, leaves the prompt
            unsteered).

    Returns:
        A :class:`Steering` handle (context manager, and ``.generate(prompt)``).
    """
    strength = checks.strength("strength", strength)
    if focus:
        _refuse_with_focus(emphasize, suppress, layers, heads, scope)
        return _focus_steering(model, tokenizer, question, passages, top_k, guard, threshold)
    scope = "all" if scope is None else scope
    if scope not in SCOPES:
        raise InvalidInputError(f"scope must be one of {SCOPES}, not {scope!r}")
    emph = tuple(as_span_list(emphasize)) if emphasize not in ((), [], None) else ()
    supp = tuple(as_span_list(suppress)) if suppress not in ((), [], None) else ()
    if not emph and not supp:
        raise InvalidInputError(
            "nothing to steer: give emphasize and/or suppress spans, or focus=True"
        )
    text_cfg = model.config.get_text_config()
    n_layers, n_heads = text_cfg.num_hidden_layers, text_cfg.num_attention_heads
    layers = checks.layers(layers, n_layers)
    head_map = None
    if heads is not None:
        head_map = {int(layer): tuple(int(h) for h in hs) for layer, hs in heads.items()}
        if not head_map or not all(head_map.values()):
            raise InvalidInputError("heads is empty for some layer: nothing would be steered there")
        if layers is not None:  # both given: the listed heads, on the listed layers only
            head_map = {layer: hs for layer, hs in head_map.items() if layer in layers}
        for layer, hs in head_map.items():
            if not 0 <= layer < n_layers or any(not 0 <= h < n_heads for h in hs):
                raise InvalidInputError(
                    f"heads {{{layer}: {list(hs)}}} out of range ({n_heads} heads)"
                )
    config = SteerConfig(emph, supp, float(strength), layers, head_map, scope, protect_special)
    return Steering(model, tokenizer, config)


def _refuse_with_focus(emphasize, suppress, layers, heads, scope) -> None:
    if emphasize not in ((), [], None) or suppress not in ((), [], None):
        raise InvalidInputError(
            "steer(focus=True) chooses the spans itself: drop emphasize/suppress"
        )
    if layers is not None or heads is not None:
        raise InvalidInputError("steer(focus=True) sizes every layer's bias: drop layers/heads")
    if scope not in (None, "decode"):
        raise InvalidInputError(f"steer(focus=True) steers in scope 'decode', not {scope!r}")


def _focus_steering(model, tokenizer, question, passages, top_k, guard, threshold) -> Steering:
    if question is None:
        raise InvalidInputError("steer(focus=True) needs question=: the question's text")
    question = content_question("question", question)
    top_k = checks.count("top_k", top_k, minimum=1)
    if guard is not None and not callable(getattr(guard, "decide", None)):
        raise InvalidTypeError(
            f"guard must have a decide(original, edited, question), not {guard!r}"
        )
    if threshold is not None:
        threshold = checks.real("threshold", threshold)
    request = FocusRequest(question, passages, top_k, guard, threshold)
    config = SteerConfig((), (), 1.0, None, None, "decode", False, request)
    return Steering(model, tokenizer, config)
