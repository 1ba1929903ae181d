"""Deterministic `.pt2` archives.

PyTorch's zip writer stores a random `.data/serialization_id` in every archive (torch.export.save and
AOTInductor packages alike), so two compiles of the same graph differ by those 40 bytes. We
overwrite it in place with an id derived from the graph's cache key (same length, CRC fixed in the
local and central headers; nothing else moves, so the archive's alignment is kept).
"""
from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path

SERIALIZATION_ID = ".data/serialization_id"


def set_serialization_id(path: Path, new_id: str) -> None:
    with zipfile.ZipFile(path) as z:
        infos = [i for i in z.infolist() if i.filename.endswith(SERIALIZATION_ID)]
        if not infos:
            return
        (info,) = infos
        old = z.read(info)
        cd_offset = z.start_dir  # file offset of the central directory
    data = new_id.encode()[: len(old)].ljust(len(old), b"0")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path}: {info.filename} is compressed; cannot rewrite it in place")
    crc = zlib.crc32(data) & 0xFFFFFFFF
    with open(path, "r+b") as f:
        # local header: signature, ..., crc at +14; name/extra lengths at +26/+28
        f.seek(info.header_offset)
        head = f.read(30)
        if head[:4] != b"PK\x03\x04":
            raise ValueError(f"{path}: unexpected zip layout")
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        f.seek(info.header_offset + 14)
        f.write(struct.pack("<I", crc))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(data)
        # central directory record of the same entry: crc at +16 (read only the directory, not the
        # whole archive: packages can be large)
        f.seek(cd_offset)
        blob = f.read()
        name = info.filename.encode()
        pos = 0
        while True:
            pos = blob.find(b"PK\x01\x02", pos)
            if pos < 0:
                raise ValueError(f"{path}: central directory entry for {info.filename} not found")
            n_len = struct.unpack("<H", blob[pos + 28:pos + 30])[0]
            if blob[pos + 46:pos + 46 + n_len] == name:
                f.seek(cd_offset + pos + 16)
                f.write(struct.pack("<I", crc))
                break
            pos += 4
    with zipfile.ZipFile(path) as z:  # proves the archive is still valid
        if z.read(info.filename) != data:
            raise ValueError(f"{path}: rewriting the serialization id failed")

