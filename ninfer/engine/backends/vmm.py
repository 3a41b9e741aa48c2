"""Fixed-address device memory for model suspend (engine/suspend.py) on the cuda backend: CUDA
virtual memory management through cuda-python's driver API.

An `Arena` reserves a virtual address range once and maps physical memory into it in chunks
(cuMemCreate / cuMemMap / cuMemSetAccess, the granularity from cuMemGetAllocationGranularity); the
tensors handed out are torch views of that memory (__cuda_array_interface__), so CUDA Graphs captured
over them stay valid while the physical memory comes and goes: `release()` unmaps and frees the
physical memory (the addresses stay reserved), `restore()` creates fresh physical memory and maps it
at the same addresses (its contents are undefined: the runner uploads the weights and copies the
retained state back). The address range goes back to the driver when the arena is collected, which
is after the last tensor over it.

`adopt(roots)` moves the storages of every tensor reachable from `roots` (objects, lists, dicts:
the runner's weights, its step buffers) into a new arena, repointing each tensor in place
(`Tensor.set_`), so the objects that hold them need not change; `copy_into` fills an adoption's
blocks from a fresh build of the same objects. `supported(device)` says whether the device has VMM
(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED).

`HostArena`, a host-memory stand-in with the same interface (a release overwrites its bytes), lets
the adoption be tested where there is no GPU.
"""
from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ninfer.errors import NInferError

log = logging.getLogger("ninfer.engine.vmm")
ALIGN = 256  # every block's start: the kernels' vector loads need 16, the caching allocator gives 512


def _check(result: Any, what: str) -> Any:
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise NInferError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def supported(device: torch.device) -> bool:
    """Whether the device supports CUDA virtual memory management (False when the driver or
    cuda-python is missing)."""
    try:
        from cuda.bindings import driver

        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        return bool(_check(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"))
    except Exception as e:  # noqa: BLE001 - no VMM: the caller falls back
        log.debug("CUDA virtual memory management unavailable: %s", e)
        return False


class _Block:
    """What torch.as_tensor reads: `nbytes` bytes at `address`; the tensor keeps this object (and
    through it the arena) alive."""

    def __init__(self, arena: Arena, address: int, nbytes: int) -> None:
        self.arena = arena
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3, "stream": None}


class Arena:
    """Up to `nbytes` of device memory at a fixed virtual address, handed out as tensors in order;
    physical memory is mapped in chunks as the tensors need it (an adoption's peak stays near one
    copy), and all of it is released and restored together."""

    CHUNK = 256 << 20

    def __init__(self, device: torch.device, nbytes: int) -> None:
        from cuda.bindings import driver

        self.device = device
        _check(driver.cuInit(0), "cuInit")
        self._dev = _check(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")
        self._context = _check(driver.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index or 0
        self._prop = prop
        granularity = int(_check(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self.chunk = _align(min(self.CHUNK, max(nbytes, 1)), granularity)
        self.capacity = _align(max(nbytes, 1), self.chunk)  # reserved addresses
        self._handles: list[Any] = []  # one per mapped chunk, in address order
        self._chunks = 0  # chunks the handed-out tensors need (mapped while resident)
        self._used = 0
        self._base = None
        with self._current():
            self._base = _check(driver.cuMemAddressReserve(self.capacity, granularity, driver.CUdeviceptr(0), 0), "cuMemAddressReserve")
        self.address = int(self._base)

    @property
    def nbytes(self) -> int:
        """Physical bytes while resident."""
        return self._chunks * self.chunk

    # -- handing out -------------------------------------------------------------------------------

    def empty(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of the next bytes of the arena."""
        shape = tuple(shape)
        nbytes = _numel(shape) * _itemsize(dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self.device)
        start = _align(self._used, ALIGN)
        if start + nbytes > self.capacity:
            raise NInferError(f"arena of {self.capacity} bytes cannot hold {nbytes} more at {start}")
        if not self.mapped and self._chunks:
            raise NInferError("the arena is released")
        with self._current():
            while self._chunks * self.chunk < start + nbytes:
                self._map_chunk(self._chunks)
                self._chunks += 1
        self._used = start + nbytes
        block = torch.as_tensor(_Block(self, self.address + start, nbytes), device=self.device)
        return block.view(dtype).view(shape)

    def zeros(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()

    def bytes_view(self) -> torch.Tensor:
        """The used part of the arena as one uint8 tensor (a host copy of it, a zero fill)."""
        return torch.as_tensor(_Block(self, self.address, max(self._used, 1)), device=self.device)

    # -- the physical memory -----------------------------------------------------------------------

    @property
    def mapped(self) -> bool:
        return len(self._handles) == self._chunks

    def release(self) -> None:
        """Unmap and free the physical memory (after the device's work is done); the addresses
        stay reserved."""
        from cuda.bindings import driver

        with self._current():
            if self._handles:
                _check(driver.cuCtxSynchronize(), "cuCtxSynchronize")  # no work left over the range
            while self._handles:
                i = len(self._handles) - 1
                _check(driver.cuMemUnmap(driver.CUdeviceptr(self.address + i * self.chunk), self.chunk), "cuMemUnmap")
                _check(driver.cuMemRelease(self._handles.pop()), "cuMemRelease")

    def restore(self) -> None:
        """Fresh physical memory at the same addresses (contents undefined). On failure nothing
        stays mapped."""
        try:
            with self._current():
                while len(self._handles) < self._chunks:
                    self._map_chunk(len(self._handles))
        except BaseException:
            self.release()
            raise

    def _map_chunk(self, i: int) -> None:
        from cuda.bindings import driver

        address = driver.CUdeviceptr(self.address + i * self.chunk)
        handle = _check(driver.cuMemCreate(self.chunk, self._prop, 0), "cuMemCreate")
        try:
            _check(driver.cuMemMap(address, self.chunk, 0, handle, 0), "cuMemMap")
            try:
                access = driver.CUmemAccessDesc()
                access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = self.device.index or 0
                access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                _check(driver.cuMemSetAccess(address, self.chunk, [access], 1), "cuMemSetAccess")
            except BaseException:
                driver.cuMemUnmap(address, self.chunk)
                raise
        except BaseException:
            driver.cuMemRelease(handle)
            raise
        self._handles.append(handle)

    def _current(self):
        """The device's primary context current on this thread for the driver calls."""
        return _pushed(self._context)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the driver frees it with the process
            from cuda.bindings import driver

            if getattr(self, "_base", None) is None:
                return
            self.release()
            with self._current():
                driver.cuMemAddressFree(self._base, self.capacity)
            self._base = None
            driver.cuDevicePrimaryCtxRelease(self._dev)


@contextlib.contextmanager
def _pushed(context: Any) -> Iterator[None]:
    from cuda.bindings import driver

    _check(driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
    try:
        yield
    finally:
        driver.cuCtxPopCurrent()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class HostArena:
    """The Arena interface over a CPU tensor (tests of the adoption without a GPU)."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = torch.device("cpu")
        self.nbytes = self.capacity = _align(max(nbytes, 1), ALIGN)
        self._memory = torch.empty(self.nbytes, dtype=torch.uint8)
        self.address = self._memory.data_ptr()
        self._used = 0
        self._mapped = True

    def empty(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(shape)
        nbytes = _numel(shape) * _itemsize(dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        start = _align(self._used, ALIGN)
        if start + nbytes > self.nbytes:
            raise NInferError(f"arena of {self.nbytes} bytes cannot hold {nbytes} more at {start}")
        self._used = start + nbytes
        # its own storage per block over the arena's bytes, as torch.as_tensor gives on a GPU
        block = torch.from_numpy(self._memory.numpy()[start:start + nbytes])
        return block.view(dtype).view(shape)

    def zeros(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()

    def bytes_view(self) -> torch.Tensor:
        return self._memory[:max(self._used, 1)]

    @property
    def mapped(self) -> bool:
        return self._mapped

    def release(self) -> None:
        self._memory.fill_(0xA5)  # what was there is gone
        self._mapped = False

    def restore(self) -> None:
        self._mapped = True  # contents undefined, as on a GPU


class Skip:
    """Roots for `storages` that leave out objects of `types` (not descended into)."""

    def __init__(self, roots: object, types: tuple[type, ...]) -> None:
        self.roots, self.types = roots, types


def storages(roots: object, device: torch.device) -> list[tuple[torch.UntypedStorage, list[torch.Tensor]]]:
    """The distinct storages on `device` of the tensors reachable from `roots` (and their view
    bases), each with the tensors over it, in a fixed walk order (the same structure walks the
    same way, wherever its storages are)."""
    skip_types: tuple[type, ...] = ()
    while isinstance(roots, Skip):
        skip_types += roots.types
        roots = roots.roots
    found: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    seen: set[int] = set()
    stack = [roots]
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, _ATOMS) or (skip_types and isinstance(obj, skip_types)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if obj.device == device and storage.nbytes():
                found.setdefault(storage.data_ptr(), (storage, []))[1].append(obj)
                stack.append(obj._base)
            continue
        if isinstance(obj, dict):
            stack.extend(reversed(list(obj.values())))
        elif isinstance(obj, (list, tuple)):
            stack.extend(reversed(obj))
        else:
            stack.extend(reversed(list(getattr(obj, "__dict__", {}).values())))
            for name in reversed(getattr(type(obj), "__slots__", ())):
                stack.append(getattr(obj, name, None))
    return list(found.values())


_ATOMS = (str, bytes, int, float, bool, torch.dtype, torch.device, type, types.ModuleType, types.FunctionType,
          types.BuiltinFunctionType, types.MethodType)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def movable(groups: list[tuple[torch.UntypedStorage, list[torch.Tensor]]]) -> str | None:
    """None when every storage is held only by the tensors found over it; else why not (a holder
    outside the walk would keep the old storage and see a stale copy after a move)."""
    for storage, tensors in groups:
        holders = torch._C._storage_Use_Count(storage._cdata) - 1  # less this Python storage object
        if holders != len(tensors):
            return f"a storage of {storage.nbytes()} bytes has {holders} holders, {len(tensors)} of them found"
    return None


@dataclass(slots=True)
class Adopted:
    """An adoption: its arena, the new blocks (uint8, walk order) and the walk positions they
    took (storages already in an earlier arena were left where they are)."""

    arena: Any
    blocks: list[torch.Tensor]
    taken: list[int]


def adopt(roots: object, device: torch.device, arena_type: type = Arena, after: Iterable[Any] = (),
          flush_bytes: int = 1 << 30) -> Adopted:
    """Move every storage reachable from `roots`, except those already inside the arenas `after`,
    into a new arena sized for them; each tensor over a storage is repointed to the same offset in
    its new block. The old storages go back to the caching allocator (emptied every `flush_bytes`,
    so the peak stays near one copy). Raises NInferError, having moved nothing, when a storage is
    also held from outside `roots` (that holder would see a stale copy)."""
    groups = storages(roots, device)
    ranges = [(a.address, a.address + a.capacity) for a in after]
    taken = [i for i, (s, _) in enumerate(groups) if not any(lo <= s.data_ptr() < hi for lo, hi in ranges)]
    why = movable([groups[i] for i in taken])
    if why is not None:
        raise NInferError(f"cannot move to fixed addresses: {why}")
    arena = arena_type(device, sum(_align(groups[i][0].nbytes(), ALIGN) for i in taken))
    blocks, moved = [], 0
    for i in taken:
        storage, tensors = groups[i]
        groups[i] = None  # type: ignore[call-overload]  # the old storage goes back to the allocator below
        block = arena.empty((storage.nbytes(),), torch.uint8)
        block.copy_(_bytes_of(storage, device))
        base = block.storage_offset()  # bytes into the block's storage (0 for a GPU arena's own)
        for t in tensors:
            t.set_(block.untyped_storage(), base // t.element_size() + t.storage_offset(), t.size(), t.stride())
        blocks.append(block)
        moved += storage.nbytes()
        del storage, tensors
        if device.type == "cuda" and moved >= flush_bytes:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            moved = 0
    del groups
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return Adopted(arena, blocks, taken)


def copy_into(adopted: Adopted, roots: object, device: torch.device) -> int:
    """Copy the storages reachable from `roots` (a fresh build of the objects an adoption walked)
    into its blocks, position by position. -> bytes copied. Raises when the structures differ."""
    fresh = storages(roots, device)
    if max(adopted.taken, default=-1) >= len(fresh) or \
            [b.numel() for b in adopted.blocks] != [fresh[i][0].nbytes() for i in adopted.taken]:
        raise NInferError("the weights built again differ in layout from the ones at fixed addresses")
    for block, i in zip(adopted.blocks, adopted.taken):
        block.copy_(_bytes_of(fresh[i][0], device))
    return sum(b.numel() for b in adopted.blocks)
