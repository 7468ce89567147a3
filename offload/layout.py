"""The shape of an engine's device KV pool, and the page-major host layout kvlife copies into.

Serving engines keep KV in one of a few shapes, all indexed by token *slot*:

* ``"per_layer"``: one tensor per layer for K and one for V, each ``[slots, heads, head_dim]``.
* ``"stacked"``: one tensor ``[layers, 2, slots, heads, head_dim]`` (K and V stacked).
* ``"mla"``: one latent buffer per layer, ``[slots, latent_dim]`` (multi-head latent
  attention caches a single compressed vector per token and layer).
* ``"blocks"``: block-paged engines whose unit is a whole block (vLLM): one tensor per
  component shaped ``[blocks, *block_shape]``, with any strides (the block's interior is
  the engine's business, K and V may be interleaved in it). A "slot" is a block and a
  host page holds one block of every component (``page_size`` 1).

kvlife sees every shape as a list of *components*: 2-D views ``[slots, elems]`` (one per
layer and K/V, or one per layer for MLA). A host page holds ``page_size`` tokens of every
component, component-major inside the page (``[components, page_size, elems]``), so one
host page is one contiguous block: a request's pages can be copied in large runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

LayoutKind = Literal["per_layer", "stacked", "mla", "blocks"]


class LayoutError(ValueError):
    """Device tensors do not match the layout they were declared with. Nothing was built."""


@dataclass(frozen=True)
class KVLayout:
    """What the device KV pool looks like.

    Attributes:
        kind: ``"per_layer"``, ``"stacked"``, ``"mla"`` or ``"blocks"``.
        layers: transformer layers (for ``"blocks"``: component tensors).
        slots: token slots in the device pool (for ``"blocks"``: blocks).
        heads: KV heads per layer (1 for MLA and blocks).
        head_dim: elements per head (the latent size for MLA, a block's elements for
            blocks).
        dtype: element type of the pool.
        page_size: tokens per host page; offload chunks are whole pages (1 for blocks).
        block_shape: ``"blocks"`` only: the shape of one block of one component.
    """

    kind: LayoutKind
    layers: int
    slots: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int = 16
    block_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("per_layer", "stacked", "mla", "blocks"):
            raise LayoutError(f"unknown layout kind {self.kind!r}")
        for name in ("layers", "slots", "heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"{name} must be a positive int, got {value!r}")
        if self.kind == "mla" and self.heads != 1:
            raise LayoutError(
                f"an MLA layout has one latent per token and layer, heads={self.heads}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.kind == "blocks":
            shape = self.block_shape
            if (
                not shape
                or not all(isinstance(d, int) and d > 0 for d in shape)
                or math.prod(shape) != self.head_dim
                or self.heads != 1
                or self.page_size != 1
            ):
                raise LayoutError(
                    f"a blocks layout needs a block_shape of positive ints whose product is "
                    f"head_dim, heads=1 and page_size=1; got block_shape={shape!r}, "
                    f"head_dim={self.head_dim}, heads={self.heads}, page_size={self.page_size}"
                )
        elif self.block_shape:
            raise LayoutError(f"block_shape is for blocks layouts, not {self.kind!r}")

    @classmethod
    def mla(
        cls, layers: int, slots: int, latent_dim: int, dtype: torch.dtype, page_size: int = 16
    ) -> KVLayout:
        """An MLA layout: one ``[slots, latent_dim]`` buffer per layer."""
        return cls("mla", layers, slots, 1, latent_dim, dtype, page_size)

    @classmethod
    def blocks(
        cls, components: int, blocks: int, block_shape: Sequence[int], dtype: torch.dtype
    ) -> KVLayout:
        """A block layout: ``components`` tensors ``[blocks, *block_shape]``, one block per
        host page and component."""
        shape = tuple(block_shape)
        elems = math.prod(shape) if shape else 0
        return cls("blocks", components, blocks, 1, elems, dtype, 1, shape)

    @property
    def components(self) -> int:
        """Component views per token: ``2 * layers`` (K and V), or ``layers`` for MLA and
        blocks."""
        return self.layers if self.kind in ("mla", "blocks") else 2 * self.layers

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One host page of one component, as the device holds it: ``(page_size, elems)``,
        or ``block_shape`` for blocks."""
        return self.block_shape if self.kind == "blocks" else (self.page_size, self.elems)

    @property
    def elems(self) -> int:
        """Elements of one component of one token."""
        return self.heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV per token over every layer."""
        return self.components * self.elems * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one host page."""
        return self.bytes_per_token * self.page_size

    def allocate(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Allocate a zeroed device pool of this layout (the tensors an engine would own)."""
        if self.kind == "stacked":
            shape = (self.layers, 2, self.slots, self.heads, self.head_dim)
            return [torch.zeros(shape, dtype=self.dtype, device=device)]
        if self.kind == "mla":
            return [
                torch.zeros((self.slots, self.head_dim), dtype=self.dtype, device=device)
                for _ in range(self.layers)
            ]
        if self.kind == "blocks":
            blocks = (self.slots, *self.block_shape)
            return [
                torch.zeros(blocks, dtype=self.dtype, device=device) for _ in range(self.layers)
            ]
        per_layer = (self.slots, self.heads, self.head_dim)
        return [
            torch.zeros(per_layer, dtype=self.dtype, device=device) for _ in range(2 * self.layers)
        ]

    def component_views(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The engine's tensors as ``components`` views of shape ``[slots, elems]``
        (``[blocks, *block_shape]`` for blocks).

        For ``"per_layer"`` pass ``[k0, v0, k1, v1, ...]``; for ``"stacked"`` the one
        tensor; for ``"mla"`` one buffer per layer; for ``"blocks"`` one tensor per
        component, strided as the engine made it (returned as they are). Views share
        memory with the tensors.

        Raises:
            LayoutError: count, shape, dtype or devices do not match the layout.
        """
        tensors = list(tensors)
        expected: list[tuple[int, ...]]
        if self.kind == "stacked":
            expected = [(self.layers, 2, self.slots, self.heads, self.head_dim)]
        elif self.kind == "mla":
            expected = [(self.slots, self.head_dim)] * self.layers
        elif self.kind == "blocks":
            expected = [(self.slots, *self.block_shape)] * self.layers
        else:
            expected = [(self.slots, self.heads, self.head_dim)] * (2 * self.layers)
        if len(tensors) != len(expected):
            raise LayoutError(
                f"{self.kind} layout needs {len(expected)} tensors, got {len(tensors)}"
            )
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise LayoutError(f"KV tensors are on several devices: {sorted(map(str, devices))}")
        for i, (tensor, shape) in enumerate(zip(tensors, expected, strict=True)):
            if tuple(tensor.shape) != shape or tensor.dtype != self.dtype:
                raise LayoutError(
                    f"tensor {i}: expected {shape} {self.dtype}, got {tuple(tensor.shape)} "
                    f"{tensor.dtype}"
                )
            if self.kind != "blocks" and not tensor.is_contiguous():
                raise LayoutError(f"tensor {i} is not contiguous")
        if self.kind == "blocks":
            return tensors
        if self.kind == "stacked":
            stacked = tensors[0]
            return [
                stacked[layer, kv].reshape(self.slots, self.elems)
                for layer in range(self.layers)
                for kv in range(2)
            ]
        return [t.reshape(self.slots, self.elems) for t in tensors]


def block_views(
    caches: Mapping[str, torch.Tensor], num_blocks: int, order: tuple[int, ...] | None = None
) -> list[torch.Tensor]:
    """A block-paged engine's per-layer KV caches as one ``[num_blocks, *block]`` view per
    component (a layer, or a layer's K and V when they are split), without copying: the
    components of a ``"blocks"`` layout.

    Each tensor is either a 4-D ``[B, H, N, C]`` view (blocks, heads, tokens, content: K
    and V side by side or interleaved in it) of some allocation, with any strides, or a
    ``[2, B, ...]`` tensor (K/V split). ``B`` is ``num_blocks`` or a multiple of it
    (kernel blocks that split one engine block: they become one more dimension). When the
    engine declares the memory ``order`` of its 4-D views (outermost dimension first), the
    strides must follow it. Each view's block interior is permuted into memory order, so a
    contiguous block is copied as the bytes the engine holds.

    Raises:
        LayoutError: no tensors (or not a mapping of tensors); a tensor whose block
            dimension cannot be found; strides
            that are not the declared order's; or layers that differ in block shape or
            dtype, or sit on several devices. The message names the layer, its shape and
            strides. Nothing was built.
    """
    if not isinstance(caches, Mapping):
        raise LayoutError(f"caches must map layer names to tensors, got {caches!r:.200}")
    if not caches:
        raise LayoutError("the engine registered no KV cache tensors")
    views: list[torch.Tensor] = []
    for name, tensor in caches.items():
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"layer {name!r}: a KV cache must be a tensor, got {tensor!r:.200}")
        where = f"layer {name!r}: shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}"
        if tensor.dim() == 4:
            if order is not None and not _strides_follow(tensor, order):
                raise LayoutError(f"{where} do not follow the declared memory order {order}")
            parts = [tensor]
        elif tensor.dim() == 5 and tensor.shape[0] == 2:
            parts = [tensor[0], tensor[1]]  # K/V split: [2, B, ...]
        else:
            raise LayoutError(
                "kvlife takes per-layer block caches [blocks, heads, tokens, content] "
                f"(any strides) or [2, blocks, ...] (K/V split); {where}"
            )
        for whole in parts:
            blocks = whole.shape[0]
            if blocks % num_blocks:
                raise LayoutError(
                    f"{where}: {blocks} blocks is not a multiple of the engine's {num_blocks}"
                )
            part = whole  # kernel blocks: one engine block is `ratio` of them
            if blocks != num_blocks:
                part = whole.unflatten(0, (num_blocks, blocks // num_blocks))
            inner = sorted(range(1, part.dim()), key=lambda d: -part.stride()[d])
            views.append(part.permute(0, *inner))
    first = views[0]
    for name, view in zip(caches, views, strict=False):
        if view.shape[1:] != first.shape[1:] or view.dtype != first.dtype:
            raise LayoutError(
                f"kvlife needs one block shape and dtype for every layer; layer {name!r} "
                f"has {tuple(view.shape[1:])} {view.dtype}, the first "
                f"{tuple(first.shape[1:])} {first.dtype} (several KV cache groups, as "
                "hybrid models have, are not supported)"
            )
    devices = {view.device for view in views}
    if len(devices) != 1:
        raise LayoutError(f"KV caches are on several devices: {sorted(map(str, devices))}")
    return views


def _strides_follow(tensor: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether ``tensor``'s strides put its dimensions in memory ``order`` (outermost
    first), ignoring dimensions of size 1, whose stride says nothing."""
    sized = [d for d in order if tensor.shape[d] > 1]
    strides = [tensor.stride(d) for d in sized]
    return all(a >= b for a, b in itertools.pairwise(strides))
