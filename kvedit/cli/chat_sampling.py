"""``kvedit chat``'s sampling options (``--temperature``, ``--top-p``, ``--seed``,
``--repeat-penalty``): checked before the model loads, then :meth:`kvedit.Memory.ask`'s
sampling keywords. Greedy decoding (the default) where ``--temperature`` is 0 or left out;
``--repeat-penalty`` applies greedy or sampled.

Nothing heavy is imported at module level (``kvedit chat --help`` stays fast)."""

from __future__ import annotations

from .arguments import finite
from .status import UsageError

__all__ = ["sampling_args", "sampling_of", "with_generator"]


DEFAULT_REPEAT_PENALTY = 1.1
"""``--repeat-penalty``'s default: without it a scripted 50-turn chat locked into one answer on
both bundled models, with it neither did (reports/memory/chat_lockin.md)."""


def sampling_args(p) -> None:
    """Add the sampling options to the chat's parser ``p``."""
    group = p.add_argument_group(
        "sampling (default: greedy, the most likely token each step after the repeat penalty)"
    )
    group.add_argument(
        "--temperature",
        type=finite("--temperature"),
        default=0.0,
        metavar="T",
        help="sample each token at temperature T (above 0); 0 decodes greedily (default 0)",
    )
    group.add_argument(
        "--top-p",
        type=finite("--top-p"),
        default=None,
        metavar="P",
        help="sample only from the most likely tokens whose probabilities add up to P, in "
        "(0, 1] (default: all tokens; needs --temperature above 0)",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="N",
        help="seed the sampling (the same seed, question and memory give the same answer; "
        "default: a fresh seed; needs --temperature above 0)",
    )
    group.add_argument(
        "--repeat-penalty",
        type=finite("--repeat-penalty"),
        default=DEFAULT_REPEAT_PENALTY,
        metavar="F",
        help="make tokens already said less likely, greedy or sampled: the logit of each token "
        "of the answer so far and of the last 64 tokens before it (the question's end) is "
        "divided by F where positive, multiplied where negative (as llama.cpp's and Hugging "
        "Face's); F in (0, 10], 1.1-1.3 is usual; 1 is off (default 1.1, as ollama's: greedy "
        "small models otherwise repeat one answer turn after turn)",
    )


def sampling_of(args) -> dict:
    """``Memory.ask``'s sampling keywords from the options (``seed`` as well, for
    :func:`with_generator`), refused before the model loads where they cannot be used."""
    t = args.temperature
    if t < 0:
        raise UsageError(f"--temperature must be 0 (greedy) or above, not {t}")
    needs = [("--top-p", args.top_p), ("--seed", args.seed)]
    given = [name for name, value in needs if value is not None]
    if given and t == 0:
        raise UsageError(
            f"{', '.join(given)} without sampling: give --temperature above 0 "
            "(--temperature 0, the default, decodes greedily)"
        )
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], not {args.top_p}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be in [0, 2**63), not {args.seed}")
    penalty = args.repeat_penalty
    if not 0 < penalty <= 10:
        raise UsageError(f"--repeat-penalty must be in (0, 10] (1: off), not {penalty}")
    out = {"do_sample": True, "temperature": t, "top_p": args.top_p, "seed": args.seed} if t else {}
    if penalty != 1.0:
        out["repetition_penalty"] = penalty
    return out


def with_generator(sampling: dict, device) -> dict:
    """``sampling`` as ``Memory.ask``'s keywords: its seed a ``torch.Generator`` on the
    model's ``device`` (None: torch's own random state)."""
    keywords = dict(sampling)
    seed = keywords.pop("seed", None)
    if seed is not None:
        import torch

        keywords["generator"] = torch.Generator(device=device).manual_seed(seed)
    return keywords
