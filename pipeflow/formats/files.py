"""Every file pipeflow writes is written whole or not at all: aside under a temporary name in
its own folder, then renamed into place, so a full disk or a crash leaves what was there.
A failure raises :class:`pipeflow.faults.WriteFailed` naming the file. :func:`write_aside`
(one file), :class:`Lines` (a log a line at a time), :func:`folder_aside` (a folder),
:func:`check_folder` (a folder an app will write, refused before any work starts)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from ..faults import WriteFailed

def _aside(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_aside(path: str | os.PathLike, data: str | bytes | Callable[[BinaryIO], None],
                durable: bool = False) -> Path:
    """Write ``data`` (text as UTF-8, bytes, or a function writing to the open binary file) to
    ``path`` whole. ``durable``: fsync before the rename. WriteFailed naming ``path`` (the
    temporary file removed)."""
    path = Path(path)
    tmp = _aside(path)
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise WriteFailed(path, err) from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


class Lines:
    """A file that grows a line at a time, each line whole, reaching the file as appended; a
    failed write cuts it back to its last whole line and raises WriteFailed naming it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd: int | None = None

    def append(self, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode("utf-8")
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            end = os.fstat(self._fd).st_size
        except OSError as err:
            raise WriteFailed(self.path, err) from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            raise WriteFailed(self.path, err) from None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


@contextlib.contextmanager
def folder_aside(out: str | os.PathLike) -> Iterator[Path]:
    """A folder to fill in place of ``out``, built beside it and renamed to ``out`` (replacing one
    there) when the block ends well, removed when it fails (``out`` as it was). WriteFailed
    naming ``out``."""
    out = Path(out)
    tmp = _aside(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as err:
        raise WriteFailed(out, err) from None
    try:
        yield tmp
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        if out.exists():
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except OSError:
            if old.exists():
                os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, WriteFailed):
            raise WriteFailed(out, str(err).rsplit(": ", 1)[-1]) from None
        raise WriteFailed(out, err) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_folder(path: str | os.PathLike) -> str | None:
    """Why the folder ``path`` (made where missing) could not be written, or None; leaves
    nothing behind."""
    target = Path(path).expanduser().absolute()
    # Several processes may check one folder at once (torchrun's nodes, a multirun's jobs):
    # a folder another made meanwhile is used as it is, each probes with a file of its own,
    # and a folder another made and let go of under it is made again
    tries = 50
    for attempt in range(tries):
        made, missing, probe = [], [], target
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        if not probe.is_dir():
            if probe.exists():
                return f"{probe} is a file, not a folder"
            continue  # let go of by another meanwhile
        try:
            for folder in reversed(missing):
                try:
                    folder.mkdir()
                    made.append(folder)
                except FileExistsError:
                    pass
            probe = target / f".pipeflow-write-check-{os.getpid()}"
            with open(probe, "w"):
                pass
            probe.unlink()
            return None
        except FileNotFoundError as err:
            if attempt == tries - 1:
                return f"cannot write there ({err.strerror or err})"
        except OSError as err:
            return f"cannot write there ({err.strerror or err})"
        finally:
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()
    return "cannot write there (its folders kept disappearing while checked)"


def check_file(path: str | os.PathLike) -> str | None:
    """Why the file ``path`` could not be written, or None: a folder where the file is
    named, or a folder that cannot be written (:func:`check_folder`)."""
    target = Path(path).expanduser().absolute()
    if target.is_dir():
        return f"{target} is a folder, not a file"
    return check_folder(target.parent)
