"""The front ends' shared-memory arenas (service/link/arena.py) registered with CUDA, so that a batch's rows are copied
to the GPU from where the front end wrote them (FUSEDSERVE_PINNED_ARENAS, service/config.py).

Unregistered, the engine's thread first copies every row into the graph's pinned staging (a 256-image ResNet batch is
38 MB of uint8: milliseconds of memcpy in which the GPU waits), and the H2D copy then reads the staging. Registered
(cudaHostRegister: the pages pinned and mapped for the GPU's DMA engines), a copy from the arena is asynchronous DMA
like one from pinned memory, so the engine queues one copy per contiguous run of request slots straight into the
graph's input (service/model/runner.py) and the host is free at once.

Registration pins each arena's pages once, at the front end's first message (~0.1 s for a 256 MB arena); an arena is
unregistered when its front end goes and no batch can still read it (`retire`, then `release_retired` between two
batches). Where registration fails (an old driver, a container's limits) it is logged once and every batch is staged
as before.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap

import numpy as np

log = logging.getLogger(__name__)

# FUSEDSERVE_PINNED_ARENAS=auto registers arenas for models whose rows are at least this large: a 3x224x224 uint8 image
# is 147 KiB; the digits MLP's row is 128 bytes, for which the staging copy is nothing and one copy inside the batch's
# graph beats one copy per run outside it.
AUTO_MIN_ROW_BYTES = 16 << 10


def wanted(setting: str, device_type: str, cuda_graphs: bool, row_bytes: int) -> bool:
    """Whether an engine registers its front ends' arenas (FUSEDSERVE_PINNED_ARENAS: auto, on, off)."""
    if setting == "off" or device_type != "cuda" or not cuda_graphs:
        return False
    return setting == "on" or row_bytes >= AUTO_MIN_ROW_BYTES


def address(buf) -> int:
    """The address of a writable buffer's first byte (an mmap)."""
    view = np.frombuffer(buf, dtype=np.uint8)
    try:
        return view.ctypes.data
    finally:
        del view


def cuda_runtime_paths(maps: str = "/proc/self/maps") -> list[str]:
    """The paths of the CUDA runtime libraries this process has loaded, from its memory maps, in map order: torch's
    libcudart, and any other copy (torchvision's wheel brings its own, libcudart.<hash>.so.13, for nvJPEG)."""
    found: list[str] = []
    with contextlib.suppress(OSError), open(maps) as lines:
        for line in lines:
            fields = line.split(None, 5)  # address, perms, offset, device, inode, and the path where there is one
            if len(fields) == 6 and "/libcudart." in fields[5] and fields[5].strip() not in found:
                found.append(fields[5].strip())
    return found


def _clear_cuda_error() -> None:
    """Clear the runtime's last error after a failed registration or unregistration: torch checks cudaGetLastError
    after each launch, so an error left pending is raised by the next kernel as its own. (On an H200 with torch 2.11,
    GPU tests sharing a worker with arena registrations failed in a matmul and a cat with "resource already mapped";
    alone they pass.) torch's cudart() binding has no cudaGetLastError, and its libcudart need not be in the global
    namespace, so each loaded copy is opened by its path and its error cleared: each copy keeps its own error state,
    and torchvision's wheel loads a copy of its own (first in the maps on that host)."""
    paths = cuda_runtime_paths()
    for lib in paths or [None]:  # none by path: the global namespace
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(lib).cudaGetLastError()


class PinnedArenas:
    """The registered arenas of one engine: which host ranges the GPU reads by DMA."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._starts: list[int] = []  # sorted starts of the registered ranges
        self._ends: dict[int, int] = {}
        self._retired: list[tuple[int, mmap.mmap]] = []
        self.registered_total = 0  # arenas ever registered (tests, logs)
        self._warned = False

    def register(self, buf: mmap.mmap) -> bool:
        """Register `buf` (a writable shared mapping) with CUDA; False (logged once) where that fails or is off."""
        if not self.enabled or len(buf) == 0:
            return False
        import torch

        start = address(buf)
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(start, len(buf), 0))
        except Exception as e:  # noqa: BLE001 - no cudart binding in this torch: the same fallback
            err, why = -1, f"{type(e).__name__}: {e}"
        else:
            why = f"cudaError {err}"
        if err != 0:
            _clear_cuda_error()
            if not self._warned:
                self._warned = True
                log.warning("could not register a front end's arena of %d MB with CUDA (%s): its rows are "
                            "staged through pinned memory instead (FUSEDSERVE_PINNED_ARENAS)", len(buf) >> 20,
                            why)  # fmt: skip
            return False
        bisect.insort(self._starts, start)
        self._ends[start] = start + len(buf)
        self.registered_total += 1
        log.info("a front end's arena of %d MB registered with CUDA: its rows are copied to the GPU where they are",
                 len(buf) >> 20)  # fmt: skip
        return True

    def contains(self, ptr: int, nbytes: int) -> bool:
        """Whether [ptr, ptr + nbytes) lies inside one registered arena."""
        starts = self._starts
        if not starts:
            return False
        i = bisect.bisect_right(starts, ptr) - 1
        return i >= 0 and ptr + nbytes <= self._ends[starts[i]]

    def retire(self, buf: mmap.mmap) -> None:
        """Its front end is gone: unregister `buf` at the next `release_retired` (a batch in flight may read it)."""
        start = address(buf)
        if start in self._ends:
            self._retired.append((start, buf))

    def release_retired(self) -> None:
        """Unregister the retired arenas: called between batches, when no copy from them is queued."""
        if not self._retired:
            return
        import torch

        for start, _buf in self._retired:
            self._starts.remove(start)
            del self._ends[start]
            if int(torch.cuda.cudart().cudaHostUnregister(start)) != 0:
                _clear_cuda_error()
        self._retired.clear()

    def release_all(self) -> None:
        """Unregister every arena: the engine stops, no batch in flight. A range left registered when its mapping goes
        stays in the driver's table, and memory mapped there later (a pinned allocation, another arena) collides with
        it, as an in-process engine's stop did in the GPU tests ("resource already mapped" at a later kernel)."""
        retired = {start for start, _buf in self._retired}  # kept with their mappings until unregistered
        self._retired += [(start, None) for start in self._starts if start not in retired]
        self.release_retired()
