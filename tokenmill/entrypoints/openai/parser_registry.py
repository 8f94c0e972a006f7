"""A name -> class registry for the pluggable output parsers (`--tool-call-parser`, `--reasoning-parser`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class ParserRegistry(Generic[T]):
    """Classes registered under one or more names; `kind` names them in errors ("tool call parser")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Class decorator: make the class available under `names`."""

        def wrap(cls: T) -> T:
            for n in names:
                self._classes[n] = cls
            return cls

        return wrap

    def get(self, name: str) -> T:
        """The class registered as `name`.

        Raises:
            ValueError: no class has that name (the message lists the known ones).
        """
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"Unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}.")
        return cls

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._classes)
