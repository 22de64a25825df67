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

With ``focus=True`` (and ``question=``) no span is given: at each prompt :func:`kvedit.focus`
chooses the passages the question points at and sizes each layer's bias, while the model runs
(:class:`~kvedit.steering.plan.FocusRequest`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel

from .. import checks
from ..errors import InvalidInputError
from ..focusing.choice import ABSTAIN_THRESHOLD, DEFAULT_GUARD, content_question
from ..focusing.guard import Guard, check_guard
from ..focusing.sizing import strength_for_share, strength_from_pasta_alpha
from ..runtime import activate
from ..spans import Spans, as_span_list
from ..states.decoding import Sampling

__all__ = [
    "SCOPES",
    "SpanPlan",
    "SteerConfig",
    "Steering",
    "steer",
    "strength_for_share",
    "strength_from_pasta_alpha",
]
from .plan import SCOPES, FocusRequest, SpanPlan, SteerConfig


class Steering:
    """A steering handle: a context manager around ``model.generate``, or a wrapper.

    Create it with :func:`steer`. Plans are scoped to the context that entered the block: a
    thread started inside it is not steered unless it runs through :meth:`thread` (which
    carries the context, e.g. for ``TextIteratorStreamer``); each thread's spans stay its own.
    The handle may re-enter itself (``with s: s.generate(p)``); another steering of the same
    model inside the block raises :class:`~kvedit.errors.NestedSteeringError`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer,
        config: SteerConfig,
        *,
        max_positions: int | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.max_positions = (
            None
            if max_positions is None
            else checks.count("max_positions", max_positions, minimum=1)
        )
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
            InvalidInputError: ``prompt`` is empty, ``max_new_tokens`` is below 1, the
                prompt and ``max_new_tokens`` do not fit the model's maximum positions, or a
                sampling argument is out of range (:class:`~kvedit.states.decoding.Sampling`,
                as every kvedit decoding path checks them: ``do_sample`` a real bool, a
                temperature above 0 when sampling, ``top_k`` at least 1, ``top_p`` in (0, 1]).
        """
        prompt = checks.text("prompt", prompt, allow_empty=False)
        Sampling.of(gen_kwargs)  # do_sample, temperature, top_k, top_p checked before any work
        if "max_new_tokens" in gen_kwargs:
            gen_kwargs["max_new_tokens"] = checks.count(
                "max_new_tokens", gen_kwargs["max_new_tokens"], minimum=1
            )
        limits = {
            "reserve": gen_kwargs.get("max_new_tokens", 32),
            "max_positions": self.max_positions,
            "what": "prompt",
        }
        checks.context_fits(self.model, n_chars=len(prompt), **limits)
        tok = self.tokenizer
        enc = tok(prompt, return_offsets_mapping=True, return_tensors="pt")
        ids = enc["input_ids"]
        checks.context_fits(self.model, n_tokens=ids.shape[1], **limits)
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
    guard: Guard | None = DEFAULT_GUARD,
    threshold: float | None = ABSTAIN_THRESHOLD,
    max_positions: int | None = None,
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
            The answer is the one :meth:`kvedit.focusing.choice.Focus.generate` gives on that
            cut. Not combined with ``emphasize``/``suppress``/``layers``/``heads``; one prompt at a
            time. ``plan.found`` holds the latest :class:`~kvedit.focusing.choice.Focus`.
        question: with ``focus``, the question's text as it appears in the prompt.
        passages, top_k, guard, threshold: with ``focus``, as :func:`kvedit.focus` takes them
            (the default guard is :data:`kvedit.focusing.choice.DEFAULT_GUARD`; a guard that drops
            the edit, or a threshold no passage reaches, leaves the prompt unsteered).
        max_positions: the most positions the model attends to, for the length check of
            :meth:`Steering.generate` (prompt plus ``max_new_tokens``); None: the model
            config's ``max_position_embeddings``.

    Returns:
        A :class:`Steering` handle (context manager, and ``.generate(prompt)``).
    """
    strength = checks.strength("strength", strength)
    if focus:
        _refuse_with_focus(emphasize, suppress, layers, heads, scope)
        config = _focus_config(question, passages, top_k, guard, threshold, max_positions)
        return Steering(model, tokenizer, config, max_positions=max_positions)
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
    return Steering(model, tokenizer, config, max_positions=max_positions)


def _refuse_with_focus(emphasize, suppress, layers, heads, scope) -> None:
    if emphasize not in ((), [], None) or suppress not in ((), [], None):
        raise InvalidInputError(
            "steer(focus=True) chooses the spans itself: drop emphasize/suppress"
        )
    if layers is not None or heads is not None:
        raise InvalidInputError("steer(focus=True) sizes every layer's bias: drop layers/heads")
    if scope not in (None, "decode"):
        raise InvalidInputError(f"steer(focus=True) steers in scope 'decode', not {scope!r}")


def _focus_config(question, passages, top_k, guard, threshold, max_positions) -> SteerConfig:
    if question is None:
        raise InvalidInputError("steer(focus=True) needs question=: the question's text")
    question = content_question("question", question)
    top_k = checks.count("top_k", top_k, minimum=1)
    guard = check_guard(guard)
    if threshold is not None:
        threshold = checks.real("threshold", threshold)
    request = FocusRequest(question, passages, top_k, guard, threshold, max_positions)
    return SteerConfig((), (), 1.0, None, None, "decode", False, request)
