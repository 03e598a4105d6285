"""Atomic file writes: a reader never sees a truncated profile or result file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_text", "atomic_write_bytes", "atomic_write_json", "atomic_save"]


def _read_umask() -> int:
    """The process umask without changing it (``os.umask`` can only read by setting).

    Linux reports it in /proc/self/status; elsewhere it is read once, at import, when no
    other thread of this library can be writing files yet.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return _UMASK_AT_IMPORT


def _umask_at_import() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK_AT_IMPORT = _umask_at_import()


def atomic_save(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)``, fsync, then rename onto ``path``.

    The temporary file lives in the destination folder so the final ``os.replace`` is a
    same-filesystem rename, which POSIX makes atomic. On any error the temporary file is
    removed and ``path`` keeps its previous content (or stays absent).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the mode a plain open() would have.
        os.chmod(tmp, 0o666 & ~_read_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return atomic_save(path, write)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
