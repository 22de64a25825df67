"""One registry of things by name, the one way every kvedit registry is built.

A :class:`Registry` maps names to the things registered under them (scorer classes, cache-layer
classes, prompt renderers, blend rules, eval methods, tasks, metrics, models). A registered
thing carries its own traits (a scorer's class attributes say what a forgetting memory may do
with it), so nothing else keeps a list of the names: whoever needs them iterates the registry.

- :meth:`Registry.register` (or :meth:`Registry.decorator`) adds a thing. The same thing again
  is allowed (a module reloaded registers a class of the same module and qualified name); a
  different thing under a taken name is refused with
  :class:`~kvedit.errors.InvalidInputError`, unless ``replace=True`` says it on purpose.
- :meth:`Registry.lookup` returns the thing or raises the registry's own error class (given
  at construction: :class:`~kvedit.errors.InvalidInputError` unless a registry says otherwise)
  with a message that lists the known names.
- A registry is a mutable mapping: ``name in r``, ``r[name]`` (``KeyError`` for an unknown
  name, as a dict), iteration in registration order, :meth:`Registry.names` (sorted) and
  ``items()``. ``r[name] = thing`` and ``del r[name]`` set and remove without the check (what a
  test's ``monkeypatch.setitem``/``delitem`` does, and undoes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Generic, TypeVar

from .errors import InvalidInputError, KVEditError

__all__ = ["Registry"]

T = TypeVar("T")
Thing = TypeVar("Thing")


def same_thing(old: object, new: object) -> bool:
    """Whether ``new`` is ``old`` again: the same object, or a class or function of the same
    module and qualified name (the one a module reload makes anew)."""
    if old is new:
        return True
    key = [(getattr(x, "__module__", None), getattr(x, "__qualname__", None)) for x in (old, new)]
    return key[0] == key[1] and None not in key[0]


class Registry(MutableMapping[str, T], Generic[T]):
    """Things of one kind by name (module docstring).

    Args:
        kind: What the things are, in words, for messages (``"scorer"``, ``"method"``).
        error: The error class :meth:`lookup` raises for an unknown name (a
            :class:`~kvedit.errors.KVEditError` subclass).
    """

    def __init__(self, kind: str, *, error: type[KVEditError] = InvalidInputError) -> None:
        self.kind = kind
        self.error = error
        self._things: dict[str, T] = {}

    def register(self, name: str, thing: T, *, replace: bool = False) -> T:
        """Register ``thing`` under ``name`` and return it.

        Raises:
            InvalidInputError: ``name`` is not a non-empty string, or is taken by another
                thing (and ``replace`` is False).
        """
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"bad {self.kind} name {name!r}")
        old = self._things.get(name)
        if old is not None and not replace and not same_thing(old, thing):
            raise InvalidInputError(f"{self.kind} {name!r} is already registered")
        self._things[name] = thing
        return thing

    def decorator(self, name: str) -> Callable[[Thing], Thing]:
        """A decorator registering what it decorates under ``name`` (:meth:`register`)."""

        def register(thing: Thing) -> Thing:
            self.register(name, thing)  # type: ignore[arg-type]
            return thing

        return register

    def lookup(self, name: str) -> T:
        """The thing registered as ``name``.

        Raises:
            KVEditError: (the registry's ``error`` class) no thing of that name; the message
                lists the known names.
        """
        if isinstance(name, str) and name in self._things:
            return self._things[name]
        raise self.error(self.unknown(name))

    def unknown(self, name: object) -> str:
        """The message for an unknown ``name``: the kind, the name and the known names."""
        return f"unknown {self.kind} {name!r}; known: {', '.join(self.names()) or 'none'}"

    def names(self) -> tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._things))

    def __getitem__(self, name: str) -> T:
        return self._things[name]

    def __setitem__(self, name: str, thing: T) -> None:
        self._things[name] = thing

    def __delitem__(self, name: str) -> None:
        del self._things[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._things

    def __iter__(self) -> Iterator[str]:
        return iter(self._things)

    def __len__(self) -> int:
        return len(self._things)

    def __repr__(self) -> str:
        return f"<{self.kind} registry: {', '.join(self._things) or 'empty'}>"
