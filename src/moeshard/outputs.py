"""Output files: checked before any computing, written atomically, never a file the run reads.

``check_output_path`` runs when the options are read, so a bad path fails in a second, not after
the whole computation: it refuses a directory, a missing or unwritable directory (probed by
creating and removing a file there, which also catches read-only file systems and root's
permission bypass), anything but a regular file, and any file the run reads (the input, a file
of the checkpoint: same path or same inode).

``atomic_write`` writes to a temporary file in the target's directory, flushes it to disk and
renames it over the target (``os.replace``), so readers see the old file or the new one, never
half of one; on any failure (disk full, Ctrl-C) the temporary file is removed and the target is
left as it was. A failure to write is an ``OutputError`` (exit code 6).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from moeshard.errors import OutputError


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_path(path: str | Path, flag: str, reads: Iterable[str | Path] = ()) -> Path:
    """The path to write ``flag``'s output to, refused (ValueError naming the flag and the path)
    when it cannot be written or is one of the files in ``reads``."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"{flag}: expected a file path, got {path!r}")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: is a directory; give a file path")
    if target.exists() and not target.is_file():
        raise ValueError(f"{flag} {str(path)!r}: exists and is not a regular file")
    for read in reads:
        if _same_file(target, Path(read)):
            raise ValueError(f"{flag} {str(path)!r}: is {str(read)!r}, a file this run reads; moeshard never "
                             f"overwrites its own input -- choose another path")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: directory {str(parent)!r} does not exist")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{target.name}.", suffix=".probe")
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r}: cannot create a file in directory {str(parent)!r}: "
                         f"{exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{flag} {str(path)!r}: the file is read-only")
    return target


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Calls ``write(tmp)`` to write a temporary file next to ``path``, then renames it to ``path``.

    The new file gets the old one's permission bits, or the usual ones (0666 less the umask).
    A symbolic link is followed, as ``open(path, "w")`` would: the file it points to is replaced
    and the link kept. Raises ``OutputError`` naming the path if anything fails; nothing partial
    is left behind.
    """
    target = Path(path).resolve()
    try:
        mode = target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as exc:
        raise OutputError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """``atomic_write`` of a text file (UTF-8)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    atomic_write(path, write)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
