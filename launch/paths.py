"""The files a command reads and writes: checked before any model loads (a directory, a device,
a read-only place), and write errors that happen later (a full disk, /dev/full) named by flag
and path.

An input that is a stream (a pipe, a FIFO, /dev/stdin, the shell's `<(...)`) can be read once:
`read_input` keeps what it held, and a launcher that read it hands that to its ranks
(`rank_copy`, launch/spawn.py); a rank whose launcher did not pass on the shell's descriptor
(torchrun) reopens it through its parent (`adopt_parent_descriptor`)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TextIO

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


# The streams (non-regular input files) this process read, by the path as given, with what they
# held: they cannot be read again, and the ranks a launcher starts need it (`rank_copy`).
_STREAMS: dict[str, bytes] = {}


def read_input(path: str) -> bytes:
    """The whole content of an input file (--prompts, --baseline). What a stream held (a pipe, a
    FIFO, /dev/stdin, `<(...)`: anything but a regular file) is kept for `rank_copy`."""
    with open(path, "rb") as file:
        regular = stat.S_ISREG(os.fstat(file.fileno()).st_mode)
        data = file.read()
    if regular:
        _STREAMS.pop(path, None)
    else:
        _STREAMS[path] = data
    return data


def rank_copy(path: str, flag: str) -> IO[bytes] | None:
    """For a launcher about to start ranks whose rank 0 reads `path` (given as `flag`) again,
    after this process read it: None for a regular file, which they read as it is; for a
    stream, a private copy of what `read_input` read from it, an unnamed temporary file (gone
    once every process holding it has closed it, however they end) for the ranks to read
    instead. A stream that this process did not read through `read_input` is refused: what it
    held is gone."""
    if path in _STREAMS:
        copy = tempfile.TemporaryFile(prefix="speculant-input-")
        try:
            copy.write(_STREAMS.pop(path))
            copy.flush()
            copy.seek(0)
        except BaseException:
            copy.close()
            raise
        return copy
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # the checks before the launch name a missing file
    if stat.S_ISREG(mode):
        return None
    raise SpeculantError(
        f"{flag} {path!r} is {file_kind(mode)}, which this launcher has read and its ranks cannot "
        f"read again; write the {flag.lstrip('-')} to a file and pass that"
    )


_FD_PATH = re.compile(r"/(?:dev|proc/self)/fd/(\d+)")


def adopt_parent_descriptor(path: str | None, flag: str) -> None:
    """Make `/dev/fd/N` (a shell's `<(...)`) name in this process what it names in the parent
    that started it with that command line, when the parent did not pass descriptor N on
    (torchrun's agent passes only stdin, stdout and stderr to its ranks): the parent's N,
    reopened through /proc and placed at N here. Any other path, one that exists here, or one
    the parent lacks too (the usual check says it does not exist) is left alone; one whose
    parent descriptor cannot be opened is refused, naming the flag."""
    match = _FD_PATH.fullmatch(path or "")
    if match is None or os.path.exists(path):
        return
    fd = int(match.group(1))
    try:  # O_NONBLOCK: a FIFO with no writer left opens at once (and reads its data, then EOF)
        source = os.open(f"/proc/{os.getppid()}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SpeculantError(
            f"{flag} {path!r} is a descriptor of the shell (`<(...)`) that the launcher did not "
            f"pass on to this rank, and it cannot be reopened ({(exc.strerror or str(exc)).lower()}"
            f"); write the {flag.lstrip('-')} to a file and pass that"
        ) from None
    os.set_blocking(source, True)
    if source != fd:
        os.dup2(source, fd, inheritable=False)
        os.close(source)


# {"/dev/fd/N": the user's path} of the inputs a launcher handed its ranks as private copies
# (spawn.rank_inputs): what the ranks' messages name
SHOWN_PATHS_ENV = "SPECULANT_SHOWN_PATHS"


def shown_path(path: str) -> str:
    """The path the user gave for `path` (a rank's copy of a streamed input), else `path`."""
    try:
        names = json.loads(os.environ.get(SHOWN_PATHS_ENV) or "{}")
    except ValueError:
        return path
    return names.get(path, path) if isinstance(names, dict) else path


def same_file(a: str, b: str) -> bool:
    """Whether two paths are one regular file on disk, by device and inode: hard links,
    symlinks and other spellings (`./x`, `x`) count."""
    try:
        first, second = os.stat(a), os.stat(b)
    except OSError:
        return False
    return stat.S_ISREG(first.st_mode) and (first.st_dev, first.st_ino) == (
        second.st_dev,
        second.st_ino,
    )


# What a checkpoint directory holds that loading reads (weights, configs, tokenizer files)
CHECKPOINT_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".model", ".txt", ".tiktoken")


def check_outside_checkpoints(outputs: list, checkpoints: list) -> None:
    """Refuse, before any model loads, an output (flag, path) that would change a checkpoint
    directory (flag, dir) of the run: a path under it of a kind loading reads
    (CHECKPOINT_SUFFIXES: config.json, a weights shard, a tokenizer file, or a new shard the
    next load would read), or a link to one of its files. A JSONL output beside the model is
    no harm. Pairs whose path is None are left out."""
    for flag, path in outputs:
        if not path:
            continue
        where = os.path.realpath(path)
        for ckpt_flag, directory in checkpoints:
            if not directory or not os.path.isdir(directory):
                continue
            root = os.path.realpath(directory)
            harm = os.path.commonpath([where, root]) == root and where.endswith(CHECKPOINT_SUFFIXES)
            if not harm and os.path.exists(path):  # a hard link to one of its files
                with os.scandir(root) as entries:
                    harm = any(
                        entry.name.endswith(CHECKPOINT_SUFFIXES) and same_file(path, entry.path)
                        for entry in entries
                    )
            if harm:
                raise SpeculantError(
                    f"{flag} {path!r} would write into the {ckpt_flag} checkpoint {directory!r} "
                    "(a file loading reads); pick a path outside it"
                )


def open_output(path: str) -> TextIO:
    """`path` opened for writing text (an existing file replaced). A FIFO that no process reads
    yet would block the open with nothing said: one warning, then the wait for its reader."""
    try:
        fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        fifo = False
    if fifo:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            logging.getLogger("speculant").warning(
                "--output %s is a FIFO that no process reads yet: waiting for its reader", path
            )
        else:
            os.set_blocking(fd, True)
            return os.fdopen(fd, "w", encoding="utf-8")
    return open(path, "w", encoding="utf-8")


def write_lines(file: TextIO, lines: Iterable[str]) -> None:
    """Write whole `lines` (each ending in a newline) to `file`, an output from open_output,
    straight to its descriptor (nothing stays buffered). A write that fails part way (a full
    disk, a file size limit) or is interrupted leaves a regular file ending at its last whole
    line, so what was written before stays valid JSONL; the error is raised."""
    data = "".join(lines).encode("utf-8")
    if not data:
        return
    file.flush()  # anything written through `file` itself goes first
    fd = file.fileno()
    regular = stat.S_ISREG(os.fstat(fd).st_mode)
    start = os.lseek(fd, 0, os.SEEK_CUR) if regular else 0
    done = 0
    try:
        while done < len(data):
            done += os.write(fd, data[done:])
    except BaseException:
        if regular and done < len(data):  # cut the line the failure left half written
            whole = data.rfind(b"\n", 0, done) + 1
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start + whole)
                os.lseek(fd, start + whole, os.SEEK_SET)
        raise


def check_writable(path: str, flag: str, example: str = "out.jsonl") -> None:
    """Refuse an output path that cannot be written, before any work: a directory, a missing or
    non-directory parent, a read-only file or place. Creating a probe file (removed at once) and
    opening an existing file for append find what permission bits alone cannot (read-only
    mounts, immutable files, root). Devices and pipes (/dev/null, /dev/stdout) are accepted.
    `example` is a file name the flag takes (a directory is refused suggesting `DIR/example`:
    out.png for --plot, which would refuse out.jsonl)."""
    target = Path(path)
    parent = target.resolve().parent
    if target.is_dir():
        raise SpeculantError(
            f"{flag} {path!r} is a directory; pass a file path such as {str(target / example)!r}"
        )
    # pathlib drops a trailing '/' (and '/.'), so the checks below would pass "x.png/" and the
    # write, which gets the path as given, fail after the whole run
    if os.path.basename(path) in ("", ".", ".."):
        separators = os.sep + (os.altsep or "")
        bare = path.rstrip(separators)
        if path.endswith(tuple(separators)) and os.path.basename(bare) not in ("", ".", ".."):
            raise SpeculantError(
                f"{flag} {path!r} ends in {path[len(bare) :]!r}, which names a directory, not a "
                f"file; drop the trailing {path[len(bare) :]!r} ({bare!r})"
            )
        raise SpeculantError(
            f"{flag} {path!r} ends in {os.path.basename(bare) or os.sep!r}, which names a "
            f"directory, not a file; end the path with a file name such as {example!r}"
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


class Diagnostics:
    """sys.stderr for a run: the same stream, except that a write or flush that fails (a reader
    that closed its pipe, `| head`; a full disk; `2>/dev/full`) makes it silent instead of
    raising. Stderr carries only diagnostics (progress bars, log lines, the summary), so losing
    it must not stop the run or lose a completion. A closed descriptor 2 (`2>&-`: sys.stderr is
    None) stays silent too, rather than print(file=None) writing diagnostics to stdout."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.failed: BaseException | None = None  # the first failure (then nothing is written)

    def write(self, text: str) -> int:
        if self.stream is not None and self.failed is None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError) as exc:  # ValueError: a closed file
                self.failed = exc
        return len(text)

    def flush(self) -> None:
        if self.stream is not None and self.failed is None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as exc:
                self.failed = exc

    def isatty(self) -> bool:
        try:
            return self.stream is not None and self.failed is None and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str):  # encoding, errors, reconfigure, fileno, buffer
        if self.stream is None:
            raise AttributeError(f"stderr is closed: no {name!r}")
        return getattr(self.stream, name)


def tolerant_stderr() -> None:
    """Make sys.stderr a `Diagnostics` (once; before any logging handler or progress bar takes
    it)."""
    if not isinstance(sys.stderr, Diagnostics):
        sys.stderr = Diagnostics(sys.stderr)


def write_whole(path: str, write: Callable[[str], None]) -> None:
    """Write a whole file so that a write failing part way (a full disk, a file size limit)
    leaves what the path held before, not a cut file (a baseline the next gate reads): `write`
    fills a temporary file beside the path, renamed over it once complete, with the existing
    file's permissions (a new file's: 0o666 less the umask). A path that is not a regular file
    (/dev/stdout, a FIFO), or in a directory this process cannot create files in, is written
    directly."""
    target = Path(os.path.realpath(path))  # a symlink's file is replaced, not the link
    if target.exists() and not target.is_file():
        write(path)
        return
    mode = stat.S_IMODE(os.stat(target).st_mode) if target.exists() else None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    except PermissionError:  # a writable file in a directory closed to new files
        write(path)
        return
    os.close(fd)
    try:
        write(tmp)
        if mode is None:
            umask = os.umask(0o022)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def write_errors_named(path: str, flag: str) -> Iterator[None]:
    """Turn an OSError while writing `path` (no space left, /dev/full, an I/O error) into the
    one-line error naming the flag and the path."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):  # a FIFO or pipe whose reader went away
            fix = "keep its reader running or pick a file"
        elif exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            fix = "free space or pick another path"
        else:
            fix = "pick another path"
        raise SpeculantError(
            f"{flag} {path!r}: writing failed ({(exc.strerror or str(exc)).lower()}); {fix}"
        ) from None
