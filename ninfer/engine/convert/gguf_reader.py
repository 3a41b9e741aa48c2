"""A small GGUF (v2/v3, little-endian) reader: key/values as Python values, tensors as memory-mapped
bytes. gguf's GGUFReader builds a numpy view per string, which takes seconds on a 49k-token vocab;
this reads the same header in well under a second."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ninfer.errors import ArtifactError

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # logical, outermost first (GGUF's ne reversed): [out, in] for a linear
    data: np.ndarray  # uint8 bytes, memory-mapped

    @property
    def type_name(self) -> str:
        return self.tensor_type.name


class _Cursor:
    def __init__(self, buf: Any, src: Path) -> None:
        self.buf, self.pos, self.src = buf, 0, src

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(n)]
            if etype in _NUMPY:  # numeric arrays in one go
                dtype = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += n * dtype.itemsize
                return arr.tolist()
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ArtifactError(f"{self.src}: corrupt GGUF header (value type {vtype})")
        return self.unpack(_SCALARS[vtype])


class GGUFFile:
    """Header key/values (`fields`) and tensors of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise ArtifactError(f"{self.path}: no such file") from None
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{self.path}: cannot read ({e})") from None
        self._cursor = _Cursor(self._map, self.path)
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, ValueError, OverflowError, MemoryError, UnicodeDecodeError, IndexError) as e:
            size = len(self._map)
            where = (f"the header ends at byte {size} in the middle of an entry" if self._cursor.pos >= size - 8
                     else f"a malformed header entry near byte {self._cursor.pos}")
            raise ArtifactError(f"{self.path}: corrupt or truncated GGUF file: {where} "
                                f"({type(e).__name__}: {e})") from None

    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensor]]:
        c = self._cursor
        if bytes(self._map[:4]) != GGUF_MAGIC:
            raise ArtifactError(f"{self.path}: not a GGUF file (bad magic)")
        c.pos = 4
        version = c.unpack("<I")
        if version not in (2, 3):
            raise ArtifactError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            fields[key] = c.value(c.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            ne = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
            ttype, offset = c.unpack("<I"), c.unpack("<Q")
            infos.append((name, ne, ttype, offset))
        alignment = int(fields.get("general.alignment", 32))
        start = -(-c.pos // alignment) * alignment
        whole = np.frombuffer(self._map, dtype=np.uint8)
        tensors = []
        for name, ne, ttype, offset in infos:
            try:
                qtype = GGMLQuantizationType(ttype)
            except ValueError:
                raise ArtifactError(f"{self.path}: tensor {name} has unknown GGUF type id {ttype}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(ne, dtype=np.int64))
            nbytes = count // block * type_size
            begin = start + offset
            if begin + nbytes > whole.size:
                raise ArtifactError(f"{self.path}: truncated GGUF file (tensor {name} runs past the end)")
            tensors.append(GGUFTensor(name, qtype, tuple(reversed(ne)), whole[begin:begin + nbytes]))
        return fields, tensors
