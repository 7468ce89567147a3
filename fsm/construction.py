"""Classes whose objects only their owner makes: ``HostPages`` (made by a ``HostPagePool``).
(``Lifecycle`` and ``Ticket``, which mypyc compiles, guard their constructors with a key
only ``kvlife.fsm.registry`` holds instead: a compiled class cannot have this metaclass.)

[`NoPublicConstructor`][kvlife.fsm.construction.NoPublicConstructor] is their metaclass:
calling the class raises ``TypeError`` saying who makes them, the owner makes one with
``cls._create(...)``, and defining a subclass
raises ``TypeError`` at once (not later, when a registry would meet an object it did not
make). Type checkers see the same through ``@typing.final`` on each class.
"""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

_T = TypeVar("_T")


class NoPublicConstructor(type):
    """Metaclass of a final class that only its owner instantiates. The class may say who
    that is in a ``_made_by`` attribute (e.g. ``"LifecycleRegistry.register()"``)."""

    def __new__(
        mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any
    ) -> NoPublicConstructor:
        for base in bases:
            if isinstance(base, NoPublicConstructor):
                raise TypeError(
                    f"{base.__module__}.{base.__qualname__} cannot be subclassed: its "
                    f"objects are made by {getattr(base, '_made_by', 'its owner')} only"
                )
        return super().__new__(mcs, name, bases, namespace, **kwargs)

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            f"{cls.__qualname__} objects are made only by {getattr(cls, '_made_by', 'their owner')}"
        )

    def _create(cls: type[_T], *args: Any, **kwargs: Any) -> _T:
        """Make an object (for the owner): ``__init__`` runs as for a normal call."""
        obj: _T = super().__call__(*args, **kwargs)  # type: ignore[misc]
        return obj


__all__ = ["NoPublicConstructor"]
