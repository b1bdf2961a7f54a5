"""Reusable host memory for the batches a reshard builds.

A reshard allocates the new batch of its rank on every call, and a worker reshards
batches of about the same size every step. Fresh memory costs more than the copy into
it: the kernel has to fault in and zero every page first (a 48 MiB copy took 4 ms into
touched memory and 20-30 ms into a fresh tensor here). glibc's malloc hands back fresh
pages for every block over 32 MiB (its largest mmap threshold: one field of 512 rows of
8192 int64 tokens), and below that it did not reliably reuse a freed block either
(torch asks it for 64-byte aligned blocks; with mmap switched off, the heap grew by
48 MiB of fresh pages for each 48 MiB tensor allocated after another was freed). At
L=8192 the data-plane benchmark's three transitions took 0.10-0.72 s with malloc's
memory and 0.08-0.10 s with this. So the batches are carved out of page-aligned anonymous
mappings kept here, as PyTorch's CUDA caching allocator keeps GPU memory: a mapping is
free again once no tensor views it any more (its reference count, which every tensor
made by `torch.frombuffer` over it holds once while it lives), and then serves a later
batch of a similar size without a page fault.
"""

from __future__ import annotations

import mmap
import sys
import threading

import torch

_ALIGN = 64  # as torch's CPU allocator aligns
_GROWTH = 1.25  # a new mapping's headroom, so that the next steps' slightly larger batches reuse it
_LARGEST_FIT = 2.0  # a free mapping serves requests down to 1 / this of its size
# When a request needs a new mapping, free ones beyond this many bytes are first given back
# to the kernel, least recently used first.
KEEP_FREE_BYTES = 512 << 20
# Below this a request goes to torch's allocator: malloc reuses small blocks well.
SMALLEST = 1 << 20


class HostBuffers:
    """A pool of anonymous mappings; `take(nbytes)` returns a uint8 tensor viewing one.
    Thread-safe: one lock guards the list, so reshards may run on several threads."""

    def __init__(self, keep_free_bytes: int = KEEP_FREE_BYTES, smallest: int = SMALLEST) -> None:
        self.keep_free_bytes, self.smallest = keep_free_bytes, smallest
        self.mappings: list[mmap.mmap] = []  # least recently taken first
        self.lock = threading.Lock()

    def _free(self) -> list[mmap.mmap]:
        """The mappings no tensor views: the pool's list and getrefcount's argument are
        their only references (each tensor over a mapping holds one more while it lives)."""
        return [self.mappings[i] for i in range(len(self.mappings)) if sys.getrefcount(self.mappings[i]) == 2]

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of page-aligned memory (contents undefined) as a uint8 tensor; the
        memory goes back to the pool when the tensor and every view of it are gone."""
        if nbytes < self.smallest:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            free = self._free()
            fits = [m for m in free if nbytes <= len(m) <= _LARGEST_FIT * nbytes]
            if fits:
                mapping = min(fits, key=len)
                self.mappings.remove(mapping)
            else:
                self._release(free, beyond=self.keep_free_bytes)
                mapping = mmap.mmap(-1, aligned(int(nbytes * _GROWTH), mmap.PAGESIZE))
            self.mappings.append(mapping)
            return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)

    def free_bytes(self) -> int:
        with self.lock:
            return sum(map(len, self._free()))

    def _release(self, free: list[mmap.mmap], beyond: int) -> None:
        """Close the `free` mappings, least recently taken first, until at most `beyond`
        bytes of them are left."""
        total = sum(map(len, free))
        for mapping in free:  # least recently taken first
            if total <= beyond:
                break
            total -= len(mapping)
            self.mappings.remove(mapping)
            mapping.close()


Shapes = list[tuple[torch.dtype, tuple[int, ...]]]


def aligned(n: int, align: int) -> int:
    """`n` rounded up to a multiple of `align`."""
    return -(-n // align) * align


def _padded_sizes(shapes: Shapes, align: int) -> list[tuple[int, int]]:
    """Each field's bytes and the bytes it takes with its padding to `align`."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for dtype, shape in shapes]
    return [(n, aligned(n, align)) for n in sizes]


def carve(buffer: torch.Tensor, shapes: Shapes, align: int = _ALIGN) -> list[torch.Tensor]:
    """Tensors of these (dtype, shape)s laid out one after another in the uint8 `buffer`,
    each starting at a multiple of `align` bytes from its start (`carved_bytes` long)."""
    out, offset = [], 0
    for (dtype, shape), (nbytes, padded) in zip(shapes, _padded_sizes(shapes, align)):
        out.append(buffer[offset: offset + nbytes].view(dtype).view(shape))
        offset += padded
    return out


def carved_bytes(shapes: Shapes, align: int = _ALIGN) -> int:
    return sum(padded for _, padded in _padded_sizes(shapes, align))


BUFFERS = HostBuffers()
