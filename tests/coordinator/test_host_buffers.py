"""The reshard's reusable host memory: a mapping serves a later batch only once no
tensor views it, free mappings beyond the limit go back, small requests stay with torch."""

import mmap

import torch

from distflow.coordinator.host_buffers import HostBuffers, carve, carved_bytes

MiB = 1 << 20


def test_a_mapping_is_reused_once_no_view_of_it_is_left():
    pool = HostBuffers(smallest=0)
    first = pool.take(4 * MiB)
    address = first.data_ptr()
    view = first[MiB:].view(torch.int64)  # outlives `first`
    del first
    second = pool.take(4 * MiB)
    assert second.data_ptr() != address  # the view still holds the first mapping
    second.fill_(7)
    view.fill_(3)
    assert int(second.max()) == 7 and int(view.max()) == 3
    del view
    third = pool.take(3 * MiB)  # a smaller request fits in the freed mapping
    assert third.data_ptr() == address and len(pool.mappings) == 2
    assert address % mmap.PAGESIZE == 0


def test_a_free_mapping_much_larger_than_the_request_is_not_used_for_it():
    pool = HostBuffers(smallest=0)
    big = pool.take(16 * MiB)
    address = big.data_ptr()
    del big
    assert pool.take(2 * MiB).data_ptr() != address
    assert pool.take(15 * MiB).data_ptr() == address


def test_free_mappings_beyond_the_limit_are_given_back_oldest_first():
    pool = HostBuffers(keep_free_bytes=6 * MiB, smallest=0)
    held = [pool.take(2 * MiB) for _ in range(4)]  # 2.5 MiB mappings with the headroom
    assert pool.free_bytes() == 0
    del held
    assert pool.free_bytes() == 4 * len(pool.mappings[0])
    newest = id(pool.mappings[-1])  # not a reference: that would keep it in use
    large = pool.take(20 * MiB)  # no fit: the free ones beyond 6 MiB go back first
    assert large.numel() == 20 * MiB and pool.free_bytes() <= 6 * MiB
    assert len(pool.mappings) == 3 and newest in map(id, pool.mappings)


def test_small_requests_are_ordinary_tensors():
    pool = HostBuffers()
    small = pool.take(1000)
    assert small.numel() == 1000 and not pool.mappings


def test_carved_fields_are_aligned_and_do_not_overlap():
    shapes = [(torch.int64, (3, 5)), (torch.float32, (3, 7)), (torch.bool, (3,)), (torch.bfloat16, (3, 2, 2))]
    buffer = torch.empty(carved_bytes(shapes), dtype=torch.uint8)
    fields = carve(buffer, shapes)
    for f, (dtype, shape) in zip(fields, shapes):
        assert f.dtype == dtype and tuple(f.shape) == shape and f.data_ptr() % 64 == 0
    for i, f in enumerate(fields):
        f.view(torch.uint8).view(-1).fill_(i + 1)
    for i, f in enumerate(fields):
        assert bool((f.view(torch.uint8).view(-1) == i + 1).all())
