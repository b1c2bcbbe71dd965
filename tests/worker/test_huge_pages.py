"""Tensors moved onto transparent huge pages keep their values and identity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.huge_pages import HUGE_PAGE_BYTES, move_to_huge_pages_, thp_mode

needs_thp = pytest.mark.skipif(
    thp_mode() not in ("always", "madvise"),
    reason=f"the kernel offers no transparent huge pages on request (mode {thp_mode()})")


def anon_huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def some_weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1536, 1152, generator=g).to(torch.bfloat16)  # 3.4 MiB
    file_like = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=g)
    return [big, file_like[1000:1000 + 576 * 18].view(576, 18),  # a view inside a larger storage
            torch.randn(577, generator=g), torch.tensor([3, 1])]


@needs_thp
def test_moved_tensors_keep_their_values_and_objects_in_one_buffer_in_order():
    weights = some_weights()
    expected = [t.clone() for t in weights]
    objects = [id(t) for t in weights]
    moved = move_to_huge_pages_(weights)
    assert moved == sum(t.numel() * t.element_size() for t in weights)
    assert [id(t) for t in weights] == objects
    assert not any(t.is_inference() for t in weights)  # still usable as before, in place
    for t, e in zip(weights, expected):
        assert t.dtype == e.dtype and t.shape == e.shape and t.is_contiguous()
        assert torch.equal(t, e)
    # One buffer, but a storage per tensor: tensors of one storage are aliases to torch.
    assert len({t.untyped_storage()._cdata for t in weights}) == len(weights)
    pointers = [t.data_ptr() for t in weights]
    assert pointers == sorted(pointers) and all(p % 64 == 0 for p in pointers)
    assert pointers[0] % HUGE_PAGE_BYTES == 0


@needs_thp
def test_the_buffer_is_backed_by_huge_pages():
    weights = some_weights()
    move_to_huge_pages_(weights)
    assert anon_huge_bytes_at(weights[0].data_ptr()) >= HUGE_PAGE_BYTES


@needs_thp
def test_tensors_viewing_the_same_bytes_share_one_copy_and_others_stay():
    table = torch.randn(1024, 1024)
    head = table.detach()  # a tied LM head: another tensor, the same bytes
    strided = torch.randn(64, 64).t()
    old, before = table.data_ptr(), strided.data_ptr()
    moved = move_to_huge_pages_([table, head, table, strided])
    assert moved == table.numel() * 4
    assert head.data_ptr() == table.data_ptr() != old
    assert strided.data_ptr() == before


@needs_thp
def test_tensors_made_in_inference_mode_move_too():
    with torch.inference_mode():
        weights = some_weights()
        expected = [t.clone() for t in weights]
    move_to_huge_pages_(weights)
    assert all(torch.equal(t, e) for t, e in zip(weights, expected))


@needs_thp
def test_moved_weights_can_be_inputs_of_one_nested_compile_region():
    # The compiled decode step runs each layer as a nested compile region, which
    # refuses inputs that alias each other: moved weights must not look alike to it.
    first, second = torch.randn(64, 64), torch.randn(64, 64)
    expected = torch.ones(2, 64) @ first @ second
    move_to_huge_pages_([first, second])

    @torch.compiler.nested_compile_region
    def layer(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return x @ a @ b

    step = torch.compile(lambda x: layer(x, first, second), backend="eager", fullgraph=True)
    torch.testing.assert_close(step(torch.ones(2, 64)), expected)
