"""Files in and out: checked before any computing, written atomically, never a file the run reads.

``check_output_path`` runs when the options are read, so a bad path fails in a second, not after
the whole computation: it refuses an empty path, a name longer than the file system takes, a
directory, a missing or unwritable directory (probed by creating and removing a file there,
which also catches read-only file systems and root's permission bypass), anything but a regular
file (a device such as ``/dev/full`` is never replaced by a file), and any file the run reads
(the input, a file of the checkpoint: same path or same inode). ``check_input_file`` and
``check_input_dir`` refuse an input that is missing, of the wrong kind or unreadable, each
with its own words. Every OS error on the way is a ValueError naming the flag, the path and the
error: the command line prints it as one line (exit code 2).

``check_output_dir`` and ``atomic_write_dir`` do the same for a directory of output (a saved
checkpoint): the path must not exist, the directory is filled under a temporary name beside it
and renamed into place whole.

``atomic_write`` writes to a temporary file with a unique name (``tempfile.mkstemp``) in the
target's directory, flushes it to disk and renames it over the target (``os.replace``), so
readers see the old file or the new one, never half of one; on any failure (disk full, Ctrl-C)
the temporary file is removed and the target is left as it was. A failure to write is an
``OutputError`` (exit code 6).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from moeshard.errors import OutputError

# The part of the target's name that a temporary file's name repeats: enough to tell whose it is,
# short enough that a name the file system takes still fits with the prefix and suffix around it.
_TMP_NAME_CHARS = 64


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _name_max(directory: Path) -> int:
    """The longest file name (bytes) ``directory``'s file system takes (255 where it does not say)."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _tmp_prefix(target: Path) -> str:
    return f".{target.name[:_TMP_NAME_CHARS]}."


def check_output_path(path: str | Path, flag: str, reads: Iterable[str | Path] = ()) -> Path:
    """The path to write ``flag``'s output to, refused (ValueError naming the flag and the path)
    when it cannot be written or is one of the files in ``reads``."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"{flag}: expected a file path, got {path!r}")
    if str(path).endswith(os.sep):  # Path() drops the slash that says "a directory"
        raise ValueError(f"{flag} {str(path)!r}: names a directory; give a file path")
    try:
        return _check_output_path(Path(path), flag, reads)
    except OSError as exc:  # a name too long, a directory that cannot be searched, a loop of links
        raise ValueError(f"{flag} {str(path)!r}: {_why(exc)}") from None


def _check_output_path(target: Path, flag: str, reads: Iterable[str | Path]) -> Path:
    shown = repr(str(target))
    if target.name in ("", ".", ".."):
        raise ValueError(f"{flag} {shown}: names a directory; give a file path")
    parent = target.resolve().parent
    name_bytes, name_max = len(os.fsencode(target.name)), _name_max(parent if parent.is_dir() else Path(os.sep))
    if name_bytes > name_max:
        raise ValueError(f"{flag} {shown}: the file name is {name_bytes} bytes, longer than the {name_max} its file "
                         f"system takes")
    if target.is_dir():
        raise ValueError(f"{flag} {shown}: is a directory; give a file path")
    if target.exists() and not target.is_file():
        raise ValueError(f"{flag} {shown}: exists and is not a regular file (a device, pipe or socket is never "
                         f"replaced); give a file path")
    for read in reads:
        if _same_file(target, Path(read)):
            raise ValueError(f"{flag} {shown}: is {str(read)!r}, a file this run reads; moeshard never "
                             f"overwrites its own input -- choose another path")
    if not parent.is_dir():
        raise ValueError(f"{flag} {shown}: directory {str(parent)!r} does not exist")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=_tmp_prefix(target), suffix=".probe")
    except OSError as exc:
        raise ValueError(f"{flag} {shown}: cannot create a file in directory {str(parent)!r}: {_why(exc)}") from None
    os.close(fd)
    os.unlink(probe)
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{flag} {shown}: the file is read-only")
    return target


def check_output_dir(path: str | Path, flag: str, reads: Iterable[str | Path] = ()) -> Path:
    """The directory to create for ``flag``'s output, refused (ValueError naming the flag and the
    path) when anything exists at the path (a directory is never written into or replaced: nothing
    is overwritten), when its parent is missing or unwritable, or when it would lie inside a
    directory in ``reads`` (the checkpoint the run reads)."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"{flag}: expected a directory path, got {path!r}")
    target = Path(path)
    shown = repr(str(path))
    try:
        if target.name in ("", ".", ".."):
            raise ValueError(f"{flag} {shown}: give the path of a directory to create")
        if target.exists() or target.is_symlink():
            raise ValueError(f"{flag} {shown}: exists; moeshard creates the directory and never writes into or "
                             f"replaces one -- choose a new path")
        parent = target.resolve().parent
        for read in reads:
            if parent == Path(read).resolve() or Path(read).resolve() in parent.parents:
                raise ValueError(f"{flag} {shown}: lies inside {str(read)!r}, a directory this run reads -- choose "
                                 f"a path outside it")
        if not parent.is_dir():
            raise ValueError(f"{flag} {shown}: directory {str(parent)!r} does not exist")
        probe = tempfile.mkdtemp(dir=parent, prefix=_tmp_prefix(target), suffix=".probe")
        os.rmdir(probe)
    except OSError as exc:
        raise ValueError(f"{flag} {shown}: cannot create a directory there: {_why(exc)}") from None
    return target


def atomic_write_dir(path: str | Path, write: Callable[[str], None]) -> None:
    """Calls ``write(tmp)`` to fill a new temporary directory next to ``path``, then renames it to
    ``path``, which must not exist (``check_output_dir``): readers see no directory or the whole
    one. Raises ``OutputError`` naming the path if anything fails (the temporary directory is
    removed; a directory that appeared at ``path`` meanwhile is left as it is)."""
    target = Path(path)
    tmp = None
    try:
        tmp = tempfile.mkdtemp(dir=target.resolve().parent, prefix=_tmp_prefix(target), suffix=".tmp")
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would keep the checkpoint from its group
        write(tmp)
        if target.exists() or target.is_symlink():
            raise FileExistsError(errno.EEXIST, "it appeared while the run wrote", str(target))
        os.rename(tmp, target)
        tmp = None
    except OSError as exc:
        raise OutputError(f"cannot write {str(path)!r}: {_why(exc)}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _stat_input(path: object, flag: str, expected: str) -> tuple[Path, os.stat_result]:
    """(path, its stat) of an input the user named with ``flag``; ValueError when it is no path,
    does not exist or cannot be looked at."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"{flag}: expected {expected}, got {path!r}")
    target = Path(path)
    try:
        return target, target.stat()
    except FileNotFoundError:
        raise ValueError(f"{flag} {str(path)!r} does not exist") from None
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r}: cannot be read: {_why(exc)}") from None


def check_input_file(path: str | Path, flag: str) -> Path:
    """``path`` if it is a regular file this process can read, else ValueError naming ``flag``,
    the path and why (missing, a directory or device, unreadable: each in its own words)."""
    file, info = _stat_input(path, flag, "a file path")
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{flag} {str(path)!r}: is a directory; give a file")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{flag} {str(path)!r}: is not a regular file")
    if not os.access(file, os.R_OK):
        raise ValueError(f"{flag} {str(path)!r}: cannot be read: {os.strerror(errno.EACCES)}")
    return file


def check_input_dir(path: str | Path, flag: str) -> Path:
    """``path`` if it is a directory whose files this process can list and read, else ValueError
    naming ``flag``, the path and why."""
    directory, info = _stat_input(path, flag, "a directory")
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{flag} {str(path)!r}: is not a directory")
    if not os.access(directory, os.R_OK | os.X_OK):
        raise ValueError(f"{flag} {str(path)!r}: cannot be read: {os.strerror(errno.EACCES)} (a directory needs "
                         f"read and search permission)")
    return directory


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Calls ``write(tmp)`` to write a temporary file next to ``path``, then renames it to ``path``.

    The new file gets the old one's permission bits, or the usual ones (0666 less the umask).
    A symbolic link is followed, as ``open(path, "w")`` would: the file it points to is replaced
    and the link kept. Anything but a regular file at ``path`` (a device, a directory) is never
    replaced. Raises ``OutputError`` naming the path if anything fails; nothing partial is left
    behind.
    """
    try:
        target = Path(path).resolve()
        if target.exists() and not target.is_file():
            raise OutputError(f"cannot write {str(path)!r}: it exists and is not a regular file")
        mode = target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=_tmp_prefix(target), suffix=".tmp")
        os.close(fd)
    except OSError as exc:
        raise OutputError(f"cannot write {str(path)!r}: {_why(exc)}") from exc
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(f"cannot write {str(path)!r}: {_why(exc)}") from exc
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
