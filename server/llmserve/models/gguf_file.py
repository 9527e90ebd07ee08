"""One GGUF file's header and tensors, memory-mapped: what serving a GGUF from its blocks reads.

`GGUFFile.open(path)` parses the header (the metadata's scalar values, each tensor's name, type, dimensions and
place) and maps the file, copy-on-write, so that a tensor is a torch view of the file's pages (`blocks`): nothing
is read until a kernel touches it, and pages stay shared with the page cache. The header is checked whole before
anything is used: a file that is not a GGUF, whose header runs past its end, or whose tensors end past the end
of the file (a truncated download) raises `GGUFError` naming the file.

The parser is our own (~100 lines) rather than the `gguf` package's GGUFReader, which builds a numpy view for
every element of every metadata array: 1.9 s to open the default model's file (its 49,152 tokens and 48,900
merges) against 0.03 s here, on every start. Block sizes come from the `gguf` package (GGML_QUANT_SIZES), the one
table of block types: the kernels (engine/backends/cpu/quant.py) take theirs from it too.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF's metadata value types: the struct format of each fixed-size one; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that cannot be served as it is: not a GGUF, truncated, corrupt, or holding what llmserve does not
    compute. The message names the file."""


@dataclass(slots=True, frozen=True)
class TensorInfo:
    """One tensor as the header describes it. `dims` in GGUF's order (ne: the innermost, a row's length, first);
    `offset` from the start of the file; `nbytes` what its blocks take."""

    name: str
    kind: int  # a ggml type id (GGMLQuantizationType's value)
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """The ggml type's name ("Q4_K"), or "type N" for an id this gguf package does not know."""
        try:
            return GGMLQuantizationType(self.kind).name
        except ValueError:
            return f"type {self.kind}"

    @property
    def rows(self) -> int:
        """Rows of the 2-D matrix the tensor is (the product of every dimension but the first)."""
        rows = 1
        for d in self.dims[1:]:
            rows *= d
        return rows

    @property
    def cols(self) -> int:
        """A row's length in values (GGUF's ne[0])."""
        return self.dims[0]


@dataclass(slots=True, frozen=True)
class Metadata:
    """The header's key-value pairs: scalars and strings by key; arrays only by their length (a tokenizer's
    vocabulary is read by transformers, once, into the cached tokenizer)."""

    values: dict[str, int | float | bool | str]
    array_lengths: dict[str, int]

    def get(self, key: str, default: int | float | bool | str | None = None) -> int | float | bool | str | None:
        return self.values.get(key, default)


class GGUFFile:
    """A GGUF file, its header parsed and its bytes mapped (see the module docstring). Keep it open while any view
    from `blocks` or `floats` is in use: the views read the mapping."""

    def __init__(
        self,
        path: Path,
        version: int,
        metadata: Metadata,
        tensors: dict[str, TensorInfo],
        mapped: mmap.mmap,
        fd: int | None = None,
    ):
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self._map = mapped
        self._fd = fd  # for read_rows; None: read through the mapping
        self.size = len(mapped)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        """Parse and map `path`. Raises FileNotFoundError, or GGUFError naming the file for anything else."""
        file = Path(path).expanduser().resolve()
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{file}: not a GGUF file ({size} bytes)")
            # Copy-on-write: torch takes writable buffers without a warning; nothing here ever writes to it.
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            fd = os.dup(f.fileno())
        try:
            version, metadata, tensors = _parse(file, mapped)
        except Exception:
            mapped.close()
            os.close(fd)
            raise
        return cls(file, version, metadata, tensors, mapped, fd)

    @property
    def architecture(self) -> str:
        """general.architecture ("llama", "qwen2", ...)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture in its header")
        return arch

    @property
    def tensor_bytes(self) -> int:
        """The bytes of every tensor's blocks: what serving the file maps and reads."""
        return sum(t.nbytes for t in self.tensors.values())

    def info(self, name: str) -> TensorInfo:
        """The tensor `name`; GGUFError naming the file when it has none."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: no tensor {name!r}")
        return info

    def blocks(self, name: str) -> torch.Tensor:
        """The tensor's bytes as the file holds them, uint8 [rows, bytes of a row], a view of the mapping."""
        info = self.info(name)
        flat = torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        return flat.view(info.rows, info.nbytes // info.rows)

    def read_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """Rows `rows` of the tensor's blocks, uint8 [len(rows), bytes of a row], a copy read with pread: the bytes
        come from the page cache and never enter this process's mapping, so a tensor read a few rows at a time (the
        token embedding, whose blocks a tied LM head already holds packed) is not also counted in its resident set.
        Rows must lie in [0, rows of the tensor)."""
        info = self.info(name)
        width = info.nbytes // info.rows
        if self._fd is None:
            return self.blocks(name)[torch.tensor(rows, dtype=torch.long)].clone()
        out = bytearray(width * len(rows))
        view = memoryview(out)
        for i, row in enumerate(rows):
            got = os.preadv(self._fd, [view[i * width : (i + 1) * width]], info.offset + row * width)
            if got != width:
                raise GGUFError(f"{self.path}: tensor {name}: row {row} read {got} of {width} bytes")
        return torch.frombuffer(out, dtype=torch.uint8).view(len(rows), width)

    def floats(self, name: str) -> torch.Tensor:
        """An F32, F16 or BF16 tensor as float32, a copy, shaped as torch orders it (outermost dimension first)."""
        info = self.info(name)
        dtypes = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
        if info.kind not in dtypes:
            raise GGUFError(f"{self.path}: tensor {name} is {info.type_name}; expected F32, F16 or BF16")
        dtype = dtypes[info.kind]
        count = info.nbytes // dtype.itemsize
        values = torch.frombuffer(self._map, dtype=dtype, count=count, offset=info.offset)
        return values.float().view(tuple(reversed(info.dims)))

    def release(self, names: list[str]) -> None:
        """Drop these tensors' pages from this process's mapping (madvise DONTNEED): after their blocks were copied
        elsewhere, so that the copy is not counted twice in the resident set. The page cache keeps them; a later read
        maps them again."""
        page = mmap.PAGESIZE
        for name in names:
            info = self.info(name)
            start = -(-info.offset // page) * page  # whole pages inside the tensor only: a neighbour stays mapped
            end = (info.offset + info.nbytes) // page * page
            if end > start:
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Unmap the file; views taken from it must no longer be used."""
        self._map.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _parse(path: Path, data: mmap.mmap) -> tuple[int, Metadata, dict[str, TensorInfo]]:
    if data[:4] != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {bytes(data[:4])!r}, not {MAGIC!r})")
    reader = _Reader(data, path)
    version = reader.unpack("<I", 4)
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}; llmserve reads versions 2 and 3")
    tensor_count, kv_count = reader.unpack("<Q", 8), reader.unpack("<Q", 16)
    reader.pos = 24
    values: dict[str, int | float | bool | str] = {}
    lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key = reader.string()
        kind = reader.unpack("<I")
        if kind == _ARRAY:
            lengths[key] = reader.skip_array()
        else:
            values[key] = reader.value(kind)
    infos: list[tuple[str, int, tuple[int, ...], int]] = []
    for _ in range(tensor_count):
        name = reader.string()
        n_dims = reader.unpack("<I")
        if not 1 <= n_dims <= 4:
            raise GGUFError(f"{path}: corrupt header: tensor {name!r} has {n_dims} dimensions")
        dims = tuple(reader.unpack("<Q") for _ in range(n_dims))
        kind, offset = reader.unpack("<I"), reader.unpack("<Q")
        infos.append((name, kind, dims, offset))
    alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise GGUFError(f"{path}: corrupt header: general.alignment is {alignment!r}")
    start = -(-reader.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, kind, dims, offset in infos:
        info = TensorInfo(name, kind, dims, start + offset, _nbytes(path, name, kind, dims))
        if info.offset + info.nbytes > len(data):
            raise GGUFError(
                f"{path}: truncated: tensor {name} ends at byte {info.offset + info.nbytes:,}, the file has "
                f"{len(data):,} bytes"
            )
        tensors[name] = info
    return version, Metadata(values, lengths), tensors


def _nbytes(path: Path, name: str, kind: int, dims: tuple[int, ...]) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {name} has ggml type {kind}, which this gguf package does not know") from None
    if dims[0] % block:
        raise GGUFError(f"{path}: corrupt header: tensor {name}'s rows ({dims[0]}) are not whole blocks of {block}")
    count = 1
    for d in dims:
        count *= d
    return count // block * size


class _Reader:
    """Reads the header's values in order, each bounds-checked against the file."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data = data
        self.path = path
        self.pos = 0

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.data):
            raise GGUFError(f"{self.path}: truncated or corrupt header (it runs past the end at byte {self.pos:,})")

    def unpack(self, fmt: str, at: int | None = None) -> int:
        if at is not None:
            self.pos = at
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return int(value)

    def string(self) -> str:
        n = self.unpack("<Q")
        self._need(n)
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> int | float | bool | str:
        if kind == _STRING:
            return self.string()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFError(f"{self.path}: corrupt header: metadata value type {kind} at byte {self.pos:,}")
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value  # type: ignore[no-any-return]

    def skip_array(self) -> int:
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if kind == _STRING:
            data, pos, end = self.data, self.pos, len(self.data)
            for _ in range(count):
                if pos + 8 > end:
                    break
                pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            self.pos = pos
            self._need(0)
        elif kind == _ARRAY:
            for _ in range(count):
                self.skip_array()
        else:
            fmt = _SCALARS.get(kind)
            if fmt is None:
                raise GGUFError(f"{self.path}: corrupt header: array of value type {kind} at byte {self.pos:,}")
            self._need(count * struct.calcsize(fmt))
            self.pos += count * struct.calcsize(fmt)
        return count
