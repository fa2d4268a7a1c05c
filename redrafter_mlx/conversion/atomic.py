"""Write a folder all at once: build it next to its destination, then rename it into place."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import ConversionError


@contextlib.contextmanager
def atomic_folder(dst: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dst``; on success it becomes ``dst``.

    On any error the temporary folder is removed and ``dst`` is left as it was. An existing
    ``dst`` is replaced only with ``force``, and only once the new folder is complete.
    """
    dst = Path(dst)
    if dst.exists() and not force:
        raise ConversionError(f"{dst} exists; pass --force to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.mkdir()  # unlike mkdtemp this honours the umask (the result is a normal folder)
    try:
        yield tmp
        _replace(tmp, dst, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace(tmp: Path, dst: Path, force: bool) -> None:
    if not dst.exists():
        tmp.rename(dst)
        return
    if not force:
        raise ConversionError(f"{dst} exists; pass --force to replace it")
    old = dst.with_name(f".{dst.name}.old-{tmp.name}")
    dst.rename(old)
    try:
        tmp.rename(dst)
    except BaseException:
        old.rename(dst)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
