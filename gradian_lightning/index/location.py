"""Where an index lives: a local directory or an fsspec URL. The one place that turns `index.path` into a zarr store.

`index.path` is a local path (`runs/index`) or a URL whose protocol fsspec knows: `memory://`,
`file://`, `s3://bucket/idx`, `gs://bucket/idx`, ... URLs are opened by zarr's own `FsspecStore`
(zarr's fsspec support; nothing here reads or writes bytes itself). Credentials and options come
from fsspec's usual places: the filesystem's own (AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS) and
`FSSPEC_<PROTOCOL>_<OPTION>` environment variables, e.g. FSSPEC_S3_ENDPOINT_URL for MinIO.

A protocol whose filesystem package is missing fails here, in one line naming the package, rather
than being taken for a local directory called `s3:` (what `pathlib.Path` would make of it).
`memory://` lives in the process that wrote it: other processes (DDP ranks, Dask workers) see an
empty filesystem there.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # zarr is imported where a store is opened: checking a path needs none of its 0.5 s
    import zarr

try:
    import fcntl
except ImportError:  # Windows: no flock; a second writer there is not refused early
    fcntl = None

from gradian_lightning.errors import ConfigError

# fsspec URLs: `proto://...`, chained ones `zip://inner::file:///archive.zip` named by the first.
# The writer's lock (writer_lock), inside a local index folder; not part of the index.
LOCK_FILE = ".gradian-lock"
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def protocol_of(path: str | Path) -> Optional[str]:
    """The URL protocol of `path` ("s3" for "s3://bucket/idx"), or None for a local path."""
    match = _URL.match(str(path))
    return match.group(1).lower() if match else None


def missing_filesystem(protocol: str) -> Optional[str]:
    """None when fsspec can load the filesystem of `protocol`, else why not, naming the package to install."""
    import fsspec
    from fsspec.registry import known_implementations

    try:
        fsspec.get_filesystem_class(protocol)
        return None
    except ValueError:
        return f"fsspec knows no protocol {protocol!r}"
    except ImportError as err:
        # fsspec's registry carries the install hint for each known protocol ("Install s3fs to access S3").
        return known_implementations.get(protocol, {}).get("err") or f"its filesystem does not import ({err})"


def one_zarr_thread() -> None:
    """Make zarr encode and write chunks on one thread, unless the user chose a number
    (`zarr.config` "threading.max_workers", or ZARR_THREADING__MAX_WORKERS).

    By default zarr runs each chunk's codec and local file write on asyncio's thread pool
    (min(32, cores + 4) threads). glibc gives each thread a malloc arena of its own, and buffers made
    on one thread and freed on another fragment them: an index writer's peak RSS grew by about
    100 bytes a row (1.31x from 10^4 to 10^6 rows; benchmarks/RESULTS.md §9). The writer flushes
    one chunk at a time, so the other threads bought no speed there.
    """
    import zarr

    if zarr.config.get("threading.max_workers", None) is None:
        zarr.config.set({"threading.max_workers": 1})


class Location:
    """`index.path` resolved once: a local directory or a URL, and the zarr group there.

    Raises `ConfigError` when `path` is a URL whose filesystem is not installed.
    """

    def __init__(self, path: str | Path) -> None:
        self.text = str(path)
        self.protocol = protocol_of(self.text)
        if self.protocol is not None:
            why = missing_filesystem(self.protocol)
            if why is not None:
                raise ConfigError(
                    f"setting 'index.path'={self.text!r}: no filesystem for {self.protocol}:// is usable here ({why}); install it, or use a local directory (`gradian doctor` lists the usable protocols)"
                )
        self.local: Optional[Path] = Path(self.text) if self.protocol is None else None

    def __str__(self) -> str:
        return self.text

    @property
    def storage_options(self) -> Dict[str, Any]:
        """fsspec options for this URL: a file:// URL makes its parent directories, as a local path does."""
        return {"auto_mkdir": True} if self.protocol in ("file", "local") else {}

    def store(self, read_only: bool = True) -> Any:
        """What `zarr.open_group` and `dask.array.from_zarr` take: the local path, or zarr's `FsspecStore`."""
        if self.local is not None:
            return str(self.local)
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(self.text, storage_options=self.storage_options, read_only=read_only)

    def open_group(self, mode: str = "r") -> zarr.Group:
        """The zarr group here; `mode` as zarr's: "r" read, "r+" update, "w" create (replacing)."""
        import zarr

        if mode != "r":
            one_zarr_thread()
        return zarr.open_group(self.store(read_only=mode == "r"), mode=mode)

    def _filesystem(self) -> Tuple[Any, str]:
        from fsspec.core import url_to_fs

        return url_to_fs(self.text, **self.storage_options)

    def exists(self) -> bool:
        """Whether anything is stored here."""
        if self.local is not None:
            return self.local.exists()
        fs, path = self._filesystem()
        return bool(fs.exists(path))

    def entries(self) -> List[str]:
        """The names stored directly under this location (none where nothing is)."""
        if self.local is not None:
            return sorted(p.name for p in self.local.iterdir() if p.name != LOCK_FILE) if self.local.is_dir() else []
        fs, path = self._filesystem()
        if not fs.exists(path):
            return []
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))

    def is_empty(self) -> bool:
        """Nothing stored here, or an empty folder: a place an index can be created without removing anything."""
        if self.local is not None and self.local.exists() and not self.local.is_dir():
            return False
        return not self.entries()

    def has_file(self, name: str) -> bool:
        """Whether the file `name` is stored directly under this location."""
        if self.local is not None:
            return (self.local / name).is_file()
        fs, path = self._filesystem()
        return bool(fs.isfile(f"{path.rstrip('/')}/{name}"))

    def writer_lock(self) -> Optional[IO[str]]:
        """An exclusive lock held while one process writes a local index: a second writer is refused
        before it does any work, instead of failing minutes later on an array the first one made.

        The lock is a hidden file in the index folder (LOCK_FILE), locked with flock, so a killed
        writer releases it with its process. `unlock` removes it while still holding it, so a
        finished run leaves no file behind; a writer that opened it just before that removal holds
        a lock on a file no longer at the path, sees so, and locks the path's file again. Returns the open lock file (close it to
        release), or None where no lock is taken: a URL (object stores have no such lock), or a
        writer of this same process that an exception abandoned. Raises `ConfigError` when
        another process holds it.
        """
        if self.local is None or fcntl is None:
            return None
        self.check_creatable()
        # The folders this lock adds to the user's disk, so that a refused run takes them away again (`unlock`).
        self._made = [p for p in (self.local, *self.local.parents) if not p.exists()][::-1]
        while True:
            try:
                self.local.mkdir(parents=True, exist_ok=True)
                handle = open(self.local / LOCK_FILE, "a+")
            except OSError as err:
                raise ConfigError(
                    f"setting 'index.path'={self.text!r} cannot be created ({type(err).__name__}: {err.strerror or err}); point index.path at a folder you can write"
                ) from None
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip()
                handle.close()
                if holder == str(os.getpid()):
                    return None
                raise ConfigError(
                    f"index.path {self.text!r} is being written by another gradian process (pid {holder or '?'}); wait for it to finish, or choose another index.path"
                ) from None
            if self._holds(handle):
                break
            handle.close()  # a finished writer removed the file between our open and our flock
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        return handle

    def check_creatable(self) -> None:
        """`ConfigError` when a local index.path is a file, or lies under one, or its nearest existing
        folder takes no new entry (no permission, a read-only or virtual filesystem such as /proc):
        no index can be written there. Found before any model loads; leaves nothing behind."""
        if self.local is None:
            return
        for place in (self.local, *self.local.parents):
            if place.exists():
                if not place.is_dir():
                    what = "is a file" if place == self.local else f"lies under {str(place)!r}, a file"
                    raise ConfigError(
                        f"setting 'index.path'={self.text!r} {what}; an index is a folder: point index.path at a new or existing folder"
                    )
                self._probe(place)
                return

    def _probe(self, folder: Path) -> None:
        """Make and remove an empty folder in `folder`: permission bits and os.access cannot tell
        (root passes them; /proc and read-only mounts refuse only the write itself)."""
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".gradian-probe-", dir=folder))
        except OSError as err:
            raise ConfigError(
                f"setting 'index.path'={self.text!r} cannot be created ({type(err).__name__}: {err.strerror or err}); point index.path at a folder you can write"
            ) from None

    def unlock(self, handle: IO[str], refused: bool) -> None:
        """Release `writer_lock`'s lock and remove its file (before the release: no other writer
        holds a lock on it then); after a refusal (`refused`), also remove the folders it made, when
        nothing else was put there: a refused run leaves the disk as it was."""
        if self._holds(handle):
            with contextlib.suppress(OSError):
                (self.local / LOCK_FILE).unlink()
        handle.close()
        if not refused:
            return
        for made in reversed(getattr(self, "_made", [])):
            with contextlib.suppress(OSError):  # a folder something else was written to stays
                made.rmdir()

    def _holds(self, handle: IO[str]) -> bool:
        """Whether the open, locked `handle` is the lock file now at this location (not one removed since)."""
        try:
            return os.stat(self.local / LOCK_FILE).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            return False

    def refuse_working_folder(self) -> None:
        """`ConfigError` when this is the working folder or a folder above it: never one to remove."""
        if self.local is not None:
            here, target = Path.cwd().resolve(), self.local.resolve()
            if target == here or target in here.parents:
                raise ConfigError(
                    f"index.overwrite=true would remove {self.text!r}, the working folder or a folder above it; point index.path at a folder of its own, such as runs/index"
                )

    def not_an_index(self) -> ConfigError:
        """The refusal of a folder here that holds something other than a Gradian index, to raise.
        It suggests a folder of the index's own: index.overwrite=true would be refused here too (`remove_index`)."""
        return ConfigError(
            f"index.path {self.text!r} holds files that are not a Gradian index ({', '.join(self.entries()[:3])}); give the index a folder of its own, e.g. index.path={self.text.rstrip('/')}/gradian_index"
        )

    def remove_index(self, holds_index: bool) -> None:
        """Remove the Gradian index stored here (`index.overwrite=true`), after checking that nothing else goes with it.

        Refuses, in one `ConfigError` line, to remove the working folder or a folder above it, a
        folder that is not a Gradian index (`holds_index` False and not empty), and an index folder
        that holds anything besides zarr nodes (a config or data file put beside the arrays).
        """
        self.refuse_working_folder()
        if self.is_empty():
            return
        if not holds_index:
            raise ConfigError(
                f"index.overwrite=true removes only a Gradian index or an empty folder, and {self.text!r} holds something else ({', '.join(self.entries()[:3])}); move those files or choose another index.path"
            )
        if self.local is not None:
            # Every entry of an index is a zarr node: zarr.json, or a folder (array or group) with its own zarr.json.
            foreign = [n for n in self.entries() if n != "zarr.json" and not (self.local / n / "zarr.json").is_file()]
            if foreign:
                raise ConfigError(
                    f"index.overwrite=true would remove {self.text!r}, which holds files that are not part of the index ({', '.join(foreign[:3])}); move them out or choose another index.path"
                )
        self.remove()

    def remove(self) -> None:
        """Delete whatever is stored here (a directory tree or a file), except a local index's lock file."""
        if self.local is not None:
            if not self.local.is_dir():
                self.local.unlink()
                return
            for name in self.entries():
                entry = self.local / name
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            return
        fs, path = self._filesystem()
        fs.rm(path, recursive=True)

    def bytes_on_disk(self) -> int:
        """Bytes stored under this location."""
        if self.local is not None:
            return sum(f.stat().st_size for f in self.local.rglob("*") if f.is_file())
        fs, path = self._filesystem()
        return int(fs.du(path, total=True))
