"""The files a command reads and writes: checked before any model loads (a directory, a device,
a read-only place), and write errors that happen later (a full disk, /dev/full) named by flag
and path."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from speculant.errors import SpeculantError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISFIFO, "a pipe"),
)


def file_kind(mode: int) -> str:
    """What a stat mode is, in words ("a directory", "a character device", "a file")."""
    return next((name for test, name in _KINDS if test(mode)), "a file")


def check_readable_file(path: str, what: str, fix: str = "pass an existing .jsonl file") -> None:
    """`path` must be a file (or a pipe, for `<(...)`) that this process can read; `what` names
    it in the error ("prompts file", "--baseline") and `fix` says what to do instead."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise SpeculantError(f"{what} {path!r} does not exist; {fix}") from None
    except OSError as exc:
        raise SpeculantError(f"{what} {path!r} cannot be read ({exc.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise SpeculantError(f"{what} {path!r} is {file_kind(mode)}, not a file; {fix}")
    if not os.access(path, os.R_OK):
        raise SpeculantError(f"{what} {path!r} cannot be read (permission denied)")


def check_writable(path: str, flag: str) -> None:
    """Refuse an output path that cannot be written, before any work: a directory, a missing or
    non-directory parent, a read-only file or place. Creating a probe file (removed at once) and
    opening an existing file for append find what permission bits alone cannot (read-only
    mounts, immutable files, root). Devices and pipes (/dev/null, /dev/stdout) are accepted."""
    target = Path(path)
    parent = target.resolve().parent
    if target.is_dir():
        raise SpeculantError(
            f"{flag} {path!r} is a directory; pass a file path such as "
            f"{str(target / 'out.jsonl')!r}"
        )
    if not parent.exists():
        raise SpeculantError(
            f"{flag} {path!r}: directory does not exist; create it or pick another path"
        )
    if not parent.is_dir():
        raise SpeculantError(f"{flag} {path!r}: {str(parent)!r} is not a directory")
    try:
        if target.exists():
            if target.is_file():
                os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
            elif not os.access(target, os.W_OK):
                raise PermissionError(13, "permission denied")
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            os.unlink(target)
    except FileExistsError:
        pass  # created in between by someone else; whoever writes it decides
    except OSError as exc:
        raise SpeculantError(
            f"{flag} {path!r} cannot be written ({(exc.strerror or str(exc)).lower()}); "
            "pick a writable path"
        ) from None


@contextlib.contextmanager
def write_errors_named(path: str, flag: str) -> Iterator[None]:
    """Turn an OSError while writing `path` (no space left, /dev/full, an I/O error) into the
    one-line error naming the flag and the path."""
    try:
        yield
    except OSError as exc:
        raise SpeculantError(
            f"{flag} {path!r}: writing failed ({(exc.strerror or str(exc)).lower()}); free "
            "space or pick another path"
        ) from None
