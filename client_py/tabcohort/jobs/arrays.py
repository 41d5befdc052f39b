"""``.npz`` archives with the standard library only (tabs have no numpy).

The format is numpy's (NEP 1, "A simple file format for NumPy arrays"): a zip archive of
``NAME.npy`` members, each a ``\\x93NUMPY`` magic, a version, a header dict literal
(``descr``, ``fortran_order``, ``shape``) and the raw little-endian data. :func:`write_npz`
writes members stored (not compressed) with a fixed timestamp, so the same arrays always give
the same bytes and the same sha256 (the job's data hash, README "Write your own job").
``numpy.load`` reads what it writes; :func:`read_npz` reads numpy's ``savez`` output
(C order, the dtypes of :data:`DTYPES`).
"""

from __future__ import annotations

import ast
import io
import struct
import sys
import zipfile
from array import array
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .._compat import np

_INT32 = "i" if array("i").itemsize == 4 else "l"
_UINT32 = "I" if array("I").itemsize == 4 else "L"
#: npy ``descr`` -> stdlib array typecode (little-endian on disk; ``|`` = one byte)
DTYPES = {"<f4": "f", "<f8": "d", "|i1": "b", "|u1": "B", "<i2": "h", "<u2": "H",
          "<i4": _INT32, "<u4": _UINT32, "<i8": "q", "<u8": "Q"}
_MAGIC = b"\x93NUMPY"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_LITTLE = sys.byteorder == "little"


class ArrayFormatError(ValueError):
    """A member that is not an ``.npy`` array this module reads (its message says why)."""


@dataclass
class NdArray:
    """An n-dimensional array held as a flat stdlib ``array`` in C order.

    Attributes:
        descr: the npy dtype string (a key of :data:`DTYPES`, e.g. ``"<f4"``).
        shape: the shape; ``prod(shape) == len(data)``.
        data: the values, flat.
    """

    descr: str
    shape: tuple[int, ...]
    data: array

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def numpy(self) -> Any:
        """The same values as a numpy array (a copy-free view where possible).

        Raises:
            ImportError: numpy is not importable.
        """
        if np is None:
            raise ImportError("numpy is not importable here")
        return np.frombuffer(self.data, dtype=np.dtype(self.descr).newbyteorder("=")).reshape(self.shape)

    @classmethod
    def of(cls, value: Any) -> "NdArray":
        """An :class:`NdArray` from an ``NdArray`` or a numpy array (cast to a supported dtype:
        booleans to ``|u1``, other dtypes must be one of :data:`DTYPES`).

        Raises:
            ArrayFormatError: an unsupported type or dtype.
        """
        if isinstance(value, NdArray):
            return value
        if np is not None and isinstance(value, np.ndarray):
            a = value.astype(np.uint8) if value.dtype == np.bool_ else value
            descr = a.dtype.newbyteorder("<").str if a.dtype.itemsize > 1 else a.dtype.str
            if descr not in DTYPES:
                raise ArrayFormatError(f"dtype {a.dtype} is not supported (one of {sorted(DTYPES)}, or bool, "
                                       "kept as |u1)")
            flat = array(DTYPES[descr])
            flat.frombytes(np.ascontiguousarray(a).astype(descr).tobytes())
            if not _LITTLE:  # pragma: no cover - big-endian hosts only
                flat.byteswap()
            return cls(descr, tuple(int(s) for s in a.shape), flat)
        raise ArrayFormatError(f"expected a numpy array or an NdArray, got {type(value).__name__}")


def npy_bytes(arr: NdArray) -> bytes:
    """One array as ``.npy`` (format version 1.0) bytes."""
    shape = repr(tuple(int(s) for s in arr.shape))
    header = f"{{'descr': '{arr.descr}', 'fortran_order': False, 'shape': {shape}, }}"
    pad = 64 - (len(_MAGIC) + 4 + len(header) + 1) % 64
    header = header + " " * (pad % 64) + "\n"
    return _MAGIC + b"\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1") + _le(arr.data)


def npy_header_for(descr: str, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header alone: what a server puts before raw bytes it never decodes."""
    return npy_bytes(NdArray(descr, shape, array(DTYPES[descr])))


def _le(a: array) -> bytes:
    if _LITTLE:
        return a.tobytes()
    b = array(a.typecode, a)  # pragma: no cover - big-endian hosts only
    b.byteswap()  # pragma: no cover
    return b.tobytes()  # pragma: no cover


def parse_npy(data: bytes) -> NdArray:
    """Raises:
        ArrayFormatError: not an ``.npy`` array of a supported dtype, Fortran order, or a
            length that does not match the header's shape.
    """
    if data[:6] != _MAGIC or len(data) < 10:
        raise ArrayFormatError("not an .npy array (no \\x93NUMPY magic)")
    major = data[6]
    if major == 1:
        hlen, start = struct.unpack("<H", data[8:10])[0], 10
    elif major in (2, 3):
        hlen, start = struct.unpack("<I", data[8:12])[0], 12
    else:
        raise ArrayFormatError(f"unknown .npy format version {major}")
    try:
        header = ast.literal_eval(data[start:start + hlen].decode("latin1"))
        descr, fortran, shape = header["descr"], header["fortran_order"], tuple(header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError):
        raise ArrayFormatError("unreadable .npy header") from None
    if descr == "<b1" or descr == "|b1":
        descr = "|u1"
    if descr not in DTYPES:
        raise ArrayFormatError(f"dtype {descr!r} is not supported (one of {sorted(DTYPES)})")
    if fortran:
        raise ArrayFormatError("Fortran-order arrays are not supported (save C order)")
    if any(not isinstance(s, int) or s < 0 for s in shape):
        raise ArrayFormatError(f"bad shape {shape}")
    flat = array(DTYPES[descr])
    body = data[start + hlen:]
    n = 1
    for s in shape:
        n *= s
    if len(body) != n * flat.itemsize:
        raise ArrayFormatError(f"{len(body)} data bytes for shape {shape} of {descr}")
    flat.frombytes(body)
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        flat.byteswap()
    return NdArray(descr, shape, flat)


def write_npz(arrays: Mapping[str, Any], extra: Iterable[tuple[str, bytes]] = ()) -> bytes:
    """Arrays (numpy or :class:`NdArray`) as deterministic ``.npz`` bytes, names sorted;
    ``extra`` members (name, bytes) such as ``job.json`` come after them."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        for name in sorted(arrays):
            try:
                member = npy_bytes(NdArray.of(arrays[name]))
            except ArrayFormatError as e:   # (which entry: a dict of many said only its type)
                raise ArrayFormatError(f"{name!r}: {e}") from None
            z.writestr(zipfile.ZipInfo(f"{name}.npy", _ZIP_DATE), member)
        for name, data in extra:
            z.writestr(zipfile.ZipInfo(name, _ZIP_DATE), data)
    return buf.getvalue()


def read_npz(data: bytes, *, max_members: int = 256) -> tuple[dict[str, NdArray], dict[str, bytes]]:
    """Returns ``(arrays by name without .npy, other members by name)``.

    Raises:
        ArrayFormatError: not a zip archive, too many members, or a bad ``.npy`` member.
    """
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise ArrayFormatError("not an .npz (zip) archive") from None
    arrays: dict[str, NdArray] = {}
    other: dict[str, bytes] = {}
    with z:
        infos = z.infolist()
        if len(infos) > max_members:
            raise ArrayFormatError(f"{len(infos)} members (at most {max_members})")
        for info in infos:
            body = z.read(info)
            if info.filename.endswith(".npy"):
                try:
                    arrays[info.filename[:-4]] = parse_npy(body)
                except ArrayFormatError as e:
                    raise ArrayFormatError(f"{info.filename}: {e}") from None
            else:
                other[info.filename] = body
    return arrays, other
