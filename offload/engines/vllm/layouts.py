"""Which KV cache layout kvlife's vLLM connector asks vLLM for, and why.

A block-outermost layout (vLLM 0.33's ``BLNHC``, ``BLHNC``, ``BHLNC``) puts one block of
every layer side by side, so kvlife copies a block of the whole model as one run of bytes
by the copy engines (no kernel; see [`kvlife.offload.block_copy`][kvlife.offload.block_copy]).
The connector asks for the block-outermost layout with the block interior the attention
backend prefers (``BLNHC`` where it reads NHD, ``BLHNC`` where HND), through vLLM's
``get_required_kvcache_layout``. vLLM decides in this order: a layout already on the
cache config, what the attention backend requires, ``VLLM_KV_CACHE_LAYOUT``, the
connector's wish, then the backend's first preference; a wish the backend cannot take is
dropped with a warning. So kvlife asks only where a CUDA backend may take it:

* never with the extra-config ``block_layout: false``;
* never for an MLA model (its backends take per-layer layouts only) nor off CUDA (vLLM's
  CPU backend takes only ``LBHNC``);
* never inside vLLM's ``MultiConnector``, which refuses to start when its children wish
  different layouts (NixlConnector and OffloadingConnector wish ``LBHNC``): there kvlife's
  wish is withdrawn and its siblings' stands.

Whatever vLLM resolves, kvlife copies it: per-layer layouts by the gather path, as
before. The worker logs which layout was resolved and which copy path it gives.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from kvlife.offload.engines.vllm_common.config import ConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.kvlife")

_NHD, _HND = "BLNHC", "BLHNC"


def inside_multi_connector(depth: int = 12) -> bool:
    """Whether vLLM's ``MultiConnector.get_required_kvcache_layout`` is asking (a caller
    up the stack): it calls each child's classmethod with a copy of the config that names
    only that child, so the call stack is where the composition shows."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: PLC0415
            MultiConnector,
        )
    except ImportError:  # a vLLM without it
        return False
    frame = sys._getframe(1)
    for _ in range(depth):
        frame_or_none = frame.f_back
        if frame_or_none is None:
            return False
        frame = frame_or_none
        owner = frame.f_locals.get("cls")
        if (
            frame.f_code.co_name == "get_required_kvcache_layout"
            and isinstance(owner, type)
            and issubclass(owner, MultiConnector)
        ):
            return True
    return False


def _backend_layouts(vllm_config: VllmConfig) -> tuple[str, ...] | None:
    """The layouts the attention backend the user named declares, most preferred first;
    ``None`` when none is named or it declares none (any layout)."""
    attention = getattr(vllm_config, "attention_config", None)
    backend: Any = getattr(attention, "backend", None)
    if backend is None:
        return None
    try:
        declared = backend.get_class().supported_kv_cache_layouts()
    except Exception:  # a backend that does not import here: decide without it
        return None
    return None if declared is None else tuple(layout.name for layout in declared)


def block_layout_wish(
    vllm_config: VllmConfig, *, cuda: bool | None = None, capability: int | None = None
) -> str | None:
    """The layout kvlife's connector asks vLLM for (see the module's docstring), or
    ``None``. ``cuda`` and ``capability`` (the device's major compute capability) are
    read from vLLM's platform when not given.

    Raises:
        ValueError: the connector's extra config is not valid (as at construction).
    """
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    if not ConnectorConfig.parse(extra).block_layout:
        return None
    model = vllm_config.model_config
    if model is not None and getattr(model, "use_mla", False):
        return None
    if cuda is None or (cuda and capability is None):
        from vllm.platforms import current_platform  # noqa: PLC0415

        cuda = bool(current_platform.is_cuda()) if cuda is None else cuda
        found = current_platform.get_device_capability() if cuda else None
        capability = capability if capability is not None else (found[0] if found else None)
    if not cuda:
        return None
    if inside_multi_connector():
        logger.info(
            "kvlife: inside vLLM's MultiConnector kvlife asks for no KV cache layout (its "
            "children must agree on one); it copies whichever vLLM resolves"
        )
        return None
    declared = _backend_layouts(vllm_config)
    if declared is not None:  # follow the named backend's first interior, block-outermost
        interior = declared[0][-3:]
        outer = [name for name in declared if name.startswith("B") and name[-3:] == interior]
        return outer[0] if outer else None
    # vLLM 0.33's backends: FlashInfer on compute capability 10 prefers HND (LBHNC, BLHNC);
    # every other CUDA backend declares nothing and vLLM prefers NHD (LBNHC)
    return _HND if capability == 10 else _NHD
