"""Connector lenses: what a connector kvlife did not write keeps to itself, read so that
``KVLifeAuditConnector`` can see its copies whole.

vLLM's connector API shows a wrapper the delayed frees and asynchronous loads that
``finished_sending`` and ``finished_recving`` report. Offload connectors keep their copies
in private metadata instead (vLLM's ``OffloadingConnector``: transfer jobs sent in its
connector metadata, completed through ``completed_jobs`` in its worker metadata) and key
their own state by request id. A lens knows one connector's private shapes, version by
version, and answers the wrapper four questions; the wrapper turns the answers into kvlife
tickets and verdicts. Per-connector knowledge lives in one module per connector; a
connector without a lens is relayed as before.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, Protocol

from vllm.v1.outputs import KVConnectorOutput


class Lens(Protocol):
    """What the wrapper asks of a lens (scheduler side, in the engine core)."""

    #: The wrapped connector's class name, for messages.
    name: str
    #: Whether the connector keeps state for every request it was shown until it
    #: finished (then a running request without state lost it).
    keeps_every_request: bool

    def issued(self, meta: Any) -> Iterable[tuple[Hashable, str, Any]]:
        """The copies the connector's metadata of this step orders that no report by
        request id will tell: ``(job, kind, request)`` with ``job`` a key the
        completion names again (the connector's job number, or a tuple that starts with
        it), ``kind`` ``store`` (or
        ``load``) and ``request`` the vLLM request object the connector issued it for (as
        its own state says now)."""
        ...

    def completions(self, output: KVConnectorOutput) -> Iterable[tuple[Hashable, bool, Any]]:
        """The jobs this worker output completes (every worker reported them), read
        before the connector takes the output: ``(job, ok, credited)``, ``credited``
        being the request object the connector will credit it to (``None``: none)."""
        ...

    def owner(self, rid: str) -> Any:
        """The request object the connector's state under ``rid`` belongs to (``None``:
        it keeps none)."""
        ...

    def finishing(self, request: Any) -> bool:
        """Whether the connector keeps ``request``'s state, after vLLM finished it, for
        a pass at its next step (a new request with its id must not take it)."""
        ...

    def flushes(self, request: Any) -> bool:
        """Whether that pass may order copies for ``request`` (a final store)."""
        ...


def part_of(connector: Any, class_name: str, attribute: str) -> Any:
    """``connector``'s ``attribute`` (the part of it a lens reads) when ``connector`` is a
    ``class_name``, that class or a subclass (told by name: no connector's module is
    imported to ask); ``None`` when it is not one, or has no such attribute."""
    if all(klass.__name__ != class_name for klass in type(connector).__mro__):
        return None
    return getattr(connector, attribute, None)


def lens_for(connector: Any) -> Lens | None:
    """The lens of ``connector`` (the wrapped connector's scheduler side), or ``None``."""
    from kvlife.offload.watch.vllm.lenses import (  # noqa: PLC0415
        lmcache_inprocess,
        mooncake_store,
        multi,
        offloading,
        simple_cpu,
    )

    lens: Lens | None = (
        offloading.lens_for(connector)
        or simple_cpu.lens_for(connector)
        or lmcache_inprocess.lens_for(connector)
        or mooncake_store.lens_for(connector)
        or multi.lens_for(connector, lens_for)  # its children's lenses, each over its part
    )
    return lens


__all__ = ["Lens", "lens_for", "part_of"]
