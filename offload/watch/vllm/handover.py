"""The prefill/decode hand-over as vLLM's disaggregation connectors describe it.

vLLM's ``NixlConnector`` (and the connectors that follow its proxy protocol) hand a
request from a prefill server to a decode server through ``kv_transfer_params``: the
prefill side's ``request_finished`` returns ``do_remote_prefill``, ``remote_engine_id``
(its own engine id), ``remote_request_id`` (its own request id) and ``remote_block_ids``
(the blocks it holds for the decode side to read); the proxy passes them with the prompt
to the decode server, whose ``Request.kv_transfer_params`` then carry them. The audit
wrapper writes that identity into its records (see
[`kvlife.fsm.audit.handover`][kvlife.fsm.audit.handover]) so that the two servers' logs
join into one story.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvlife.fsm.audit.handover import (
    HANDOFF_BLOCKS,
    HANDOFF_DIGEST,
    HANDOFF_ENGINE,
    HANDOFF_RID,
    PEER_BLOCKS,
    PEER_DIGEST,
    PEER_ENGINE,
    PEER_RID,
    block_digest,
)
from kvlife.fsm.audit.records import DetailValue


def _blocks(value: Any) -> list[int] | None:
    """Block ids as the params give them: a list, or one list per KV cache group (HMA)."""
    if not isinstance(value, list | tuple):
        return None
    flat: list[int] = []
    for item in value:
        if isinstance(item, list | tuple):
            flat += (int(b) for b in item)
        elif isinstance(item, int) and not isinstance(item, bool):
            flat.append(item)
        else:
            return None
    return flat


def _identity(params: Mapping[str, Any], rid: Any, names: Iterable[str]) -> dict[str, DetailValue]:
    engine = params.get("remote_engine_id")
    if not isinstance(engine, str) or not engine:
        return {}
    peer_rid = params.get("remote_request_id")
    if not isinstance(peer_rid, str) or not peer_rid:
        peer_rid = rid
    engine_key, rid_key, blocks_key, digest_key = names
    detail: dict[str, DetailValue] = {engine_key: engine}
    if isinstance(peer_rid, str):
        detail[rid_key] = peer_rid
    blocks = _blocks(params.get("remote_block_ids"))
    if blocks is not None:
        detail[blocks_key] = len(blocks)
        detail[digest_key] = block_digest(blocks)
    return detail


def handed_over(params: Any, request_id: str) -> dict[str, DetailValue]:
    """The prefill side: what ``request_finished`` returned names a decode side's read
    (``do_remote_prefill``): the detail for the delayed free and the finish; ``{}`` when
    it hands nothing over."""
    if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
        return {}
    return _identity(
        params, request_id, (HANDOFF_ENGINE, HANDOFF_RID, HANDOFF_BLOCKS, HANDOFF_DIGEST)
    )


def taken_over(request: Any) -> dict[str, DetailValue]:
    """The decode side: the prefill side the request's ``kv_transfer_params`` name (the
    request reads, or was to read, its blocks there): the detail for its load and its
    end; ``{}`` for a request that names none."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, Mapping) or "remote_engine_id" not in params:
        return {}
    if params.get("do_remote_decode"):  # a prefill request (or a turn-2 hand-back)
        return {}
    return _identity(params, None, (PEER_ENGINE, PEER_RID, PEER_BLOCKS, PEER_DIGEST))


__all__ = ["handed_over", "taken_over"]
