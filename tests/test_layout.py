"""KV layouts: the three pool shapes seen as components of ``[slots, elems]``."""

from __future__ import annotations

import pytest
import torch

from kvlife.offload import KVLayout, LayoutError

LAYOUTS = {
    "per_layer": KVLayout(
        "per_layer", layers=3, slots=64, heads=2, head_dim=4, dtype=torch.float32
    ),
    "stacked": KVLayout("stacked", layers=2, slots=64, heads=2, head_dim=8, dtype=torch.bfloat16),
    "mla": KVLayout.mla(layers=4, slots=64, latent_dim=12, dtype=torch.float16),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_components_are_views_of_the_engine_tensors(name: str) -> None:
    layout = LAYOUTS[name]
    kv = layout.allocate()
    views = layout.component_views(kv)
    assert len(views) == layout.components
    for c, view in enumerate(views):
        assert view.shape == (layout.slots, layout.elems)
        view[5] = c + 1  # writes land in the engine's tensors
    total = sum(float(t.float().sum()) for t in kv)
    assert total == sum((c + 1) * layout.elems for c in range(layout.components))


def test_bytes_per_token() -> None:
    # the reference KV: 32 layers, K+V, 8 heads, dim 128, bf16 = 128 KiB per token
    ref = KVLayout("per_layer", layers=32, slots=16, heads=8, head_dim=128, dtype=torch.bfloat16)
    assert ref.bytes_per_token == 128 * 1024
    assert ref.bytes_per_page == 16 * 128 * 1024
    assert LAYOUTS["mla"].bytes_per_token == 4 * 12 * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "paged"}, "unknown layout kind"),
        ({"layers": 0}, "layers must be a positive int"),
        ({"page_size": -16}, "page_size must be a positive int"),
        ({"slots": 1.5}, "slots must be a positive int"),
        ({"dtype": "bf16"}, "dtype must be a torch.dtype"),
        ({"kind": "mla", "heads": 2}, "one latent"),
    ],
)
def test_bad_layouts_are_refused(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = dict(
        kind="per_layer", layers=2, slots=8, heads=1, head_dim=4, dtype=torch.float32
    )
    with pytest.raises(LayoutError, match=message):
        KVLayout(**{**base, **kwargs})  # type: ignore[arg-type]


def test_tensors_that_do_not_match_are_refused() -> None:
    layout = LAYOUTS["per_layer"]
    kv = layout.allocate()
    with pytest.raises(LayoutError, match="needs 6 tensors"):
        layout.component_views(kv[:-1])
    with pytest.raises(LayoutError, match="tensor 2"):
        layout.component_views([*kv[:2], kv[2].to(torch.float16), *kv[3:]])
    with pytest.raises(LayoutError, match="not contiguous"):
        bad = torch.zeros((4, 64, 2)).transpose(0, 1)  # [64, 4, 2]
        other = KVLayout("per_layer", layers=1, slots=64, heads=4, head_dim=2, dtype=torch.float32)
        other.component_views([bad.transpose(1, 2).contiguous().transpose(1, 2), bad])


def test_a_block_layout_takes_strided_tensors_as_they_are() -> None:
    layout = KVLayout.blocks(components=3, blocks=10, block_shape=(2, 4, 6), dtype=torch.float16)
    assert (layout.components, layout.elems, layout.page_size) == (3, 48, 1)
    assert layout.page_shape == (2, 4, 6) and LAYOUTS["mla"].page_shape == (16, 12)
    assert [tuple(t.shape) for t in layout.allocate()] == [(10, 2, 4, 6)] * 3
    # one buffer, blocks outermost, layers inside each block: every view is strided
    buffer = torch.zeros(10, 3, 2, 4, 6, dtype=torch.float16)
    views = [buffer[:, layer] for layer in range(3)]
    assert layout.component_views(views) == views  # the engine's own tensors
    assert layout.bytes_per_page == 3 * 48 * 2
    with pytest.raises(LayoutError, match=r"tensor 1: expected \(10, 2, 4, 6\)"):
        layout.component_views([views[0], views[1][:, :1], views[2]])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: KVLayout.blocks(2, 8, (), torch.float32), "head_dim must be a positive int"),
        (
            lambda: KVLayout("blocks", 2, 8, 1, 4, torch.float32, 1, (2, 2.0)),  # type: ignore[arg-type]
            "block_shape of positive ints",
        ),
        (
            lambda: KVLayout("blocks", 2, 8, 1, 12, torch.float32, 1, (4, 4)),
            "whose product is head_dim",
        ),
        (lambda: KVLayout("blocks", 2, 8, 1, 16, torch.float32, 16, (16,)), "page_size=1"),
        (
            lambda: KVLayout("per_layer", 2, 8, 1, 4, torch.float32, 16, (4,)),
            "block_shape is for blocks layouts",
        ),
    ],
)
def test_bad_block_layouts_are_refused(make: object, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        make()  # type: ignore[operator]
