"""The method registry and spec strings.

A method is a :class:`Method` subclass registered by name with :func:`register_method`; its
parameters are a frozen dataclass, :attr:`Method.Params` (see :mod:`.params`). A spec string
names a method and sets some parameters, ``name`` or ``name:key=value[:key=value]``
(``auto:target=0.3``, ``oracle:edit=scale_keys:factor=1.5``); :func:`parse_spec` turns it into
a method object, and the spec is the method's key in ``results.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvedit.errors import InvalidInputError, InvalidTypeError
from kvedit.evals.methods.params import NoParams, from_text, to_dict
from kvedit.registry import Registry

if TYPE_CHECKING:
    from kvedit.evals.methods.context import ExampleContext
    from kvedit.states.state import KVState

__all__ = ["METHODS", "Method", "parse_spec", "register_method", "split_specs"]


class Method:
    """Base class of the methods: typed parameters in, an answer text out.

    ``Method(**values)`` (or ``Method(params)``, a :attr:`Params` instance) makes a method
    object; :meth:`predict` answers one example. Subclasses set :attr:`Params` (a frozen
    dataclass whose fields all have defaults) and :attr:`needs_documents`.
    """

    name: ClassVar[str] = "method"
    """The registered name (set by :func:`register_method`)."""
    Params: ClassVar[type] = NoParams
    """The frozen dataclass of the method's parameters."""
    needs_documents: ClassVar[bool] = False
    """Whether the method only makes sense on examples with documents."""
    uses_capture: ClassVar[bool] = True
    """Whether the method answers from the example's captured documents (``ctx.state``); the
    runner makes that capture before timing the methods."""

    def __init__(self, params: Any = None, /, **values: Any) -> None:
        if params is None:
            fields = {f.name for f in dataclasses.fields(self.Params) if f.init}
            unknown = sorted(set(values) - fields)
            if unknown:
                raise InvalidInputError(
                    f"method {self.name!r}: unknown parameter(s) {unknown}; "
                    f"known: {sorted(fields) or 'none'}"
                )
            params = self.Params(**values)
        elif values:
            raise InvalidInputError(f"method {self.name!r}: give params or keywords, not both")
        elif not isinstance(params, self.Params):
            raise InvalidTypeError(
                f"method {self.name!r} takes {self.Params.__name__}, not {type(params).__name__}"
            )
        self.params = params
        self.spec = self.name

    def param_dict(self) -> dict[str, Any]:
        """The resolved parameters as a plain dict (recorded as ``extra.params``)."""
        return to_dict(self.params)

    def predict(self, ctx: ExampleContext) -> str:
        """The answer to ``ctx.example``."""
        raise NotImplementedError

    @property
    def answers_from_state(self) -> bool:
        """Whether this method, with its parameters, answers by continuing one state with
        ``ctx.continuation`` greedily (:meth:`answer_state`): what another engine can serve
        (``kvedit eval litm --engine vllm``): the subclass defines :meth:`answer_state` and
        its parameters do not say otherwise (``Params.edits_cache``, which
        :class:`~kvedit.evals.methods.edits.EditParams` sets False for ``edit="steer"``)."""
        defined = type(self).answer_state is not Method.answer_state
        return defined and bool(getattr(self.params, "edits_cache", True))

    def answer_state(self, ctx: ExampleContext) -> KVState:
        """The state whose greedy continuation with ``ctx.continuation`` is this method's
        answer (:meth:`predict` gives exactly ``answer_state(ctx).generate(ctx.continuation,
        ctx.max_new_tokens)``). Leaves the same ``ctx.notes`` :meth:`predict` leaves.

        Raises:
            InvalidInputError: the method answers another way (:attr:`answers_from_state`).
        """
        raise InvalidInputError(
            f"method {self.spec!r} does not answer from one state (it runs a fresh prompt or "
            "steers the model), so only the transformers engine can run it"
        )

    def __repr__(self) -> str:
        return f"<method {self.spec!r}: {self.params!r}>"


METHODS: Registry[type[Method]] = Registry("method")
"""Method name -> method class (a :class:`kvedit.registry.Registry`)."""

MethodType = TypeVar("MethodType", bound=type[Method])


def register_method(name: str) -> Callable[[MethodType], MethodType]:
    """Class decorator registering a :class:`Method` subclass under ``name``.

    Registering a class again under its own name (as a module reload does) is allowed.

    Raises:
        InvalidInputError: ``name`` is taken by another class, contains ``:`` or ``,``, or
            the class's :attr:`~Method.Params` is not a dataclass whose fields all have
            defaults.
    """
    if not name or any(c in name for c in ":,=") or name != name.strip():
        raise InvalidInputError(f"bad method name {name!r}")

    def decorator(cls: MethodType) -> MethodType:
        if not dataclasses.is_dataclass(cls.Params):
            raise InvalidInputError(f"method {name!r}: Params must be a dataclass")
        required = [
            f.name
            for f in dataclasses.fields(cls.Params)
            if f.init
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if required:
            raise InvalidInputError(f"method {name!r}: parameter(s) {required} need defaults")
        METHODS.register(name, cls)
        cls.name = name
        return cls

    return decorator


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs, keeping commas inside brackets (``layers=(0,1)``)."""
    out, depth, cur = [], 0, []
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [s.strip() for s in out if s.strip()]


def parse_spec(spec: str) -> Method:
    """``"name:key=value:key=value"`` -> a method object with those parameters set.

    Each value is parsed by its parameter's type (:func:`.params.parse_value`); a key given
    twice takes the last value. The object's ``spec`` is ``spec``, stripped.

    Raises:
        InvalidInputError: an unknown method or parameter, a part without ``=``, or a value
            of the wrong type or out of range.
    """
    name, *parts = spec.strip().split(":")
    cls = METHODS.lookup(name)
    texts = {}
    for part in parts:
        if "=" not in part:
            raise InvalidInputError(f"bad method spec {spec!r}: expected key=value after ':'")
        key, value = part.split("=", 1)
        texts[key.strip()] = value.strip()
    method = cls(from_text(cls.Params, texts, name))
    method.spec = spec.strip()
    return method
