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

import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import zarr

from gradian_lightning.errors import ConfigError

# fsspec URLs: `proto://...`, chained ones `zip://inner::file:///archive.zip` named by the first.
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
            return sorted(p.name for p in self.local.iterdir()) if self.local.is_dir() else []
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

    def remove_index(self, holds_index: bool) -> None:
        """Remove the Gradian index stored here (`index.overwrite=true`), after checking that nothing else goes with it.

        Refuses, in one `ConfigError` line, to remove the working folder or a folder above it, a
        folder that is not a Gradian index (`holds_index` False and not empty), and an index folder
        that holds anything besides zarr nodes (a config or data file put beside the arrays).
        """
        if self.local is not None:
            here, target = Path.cwd().resolve(), self.local.resolve()
            if target == here or target in here.parents:
                raise ConfigError(
                    f"index.overwrite=true would remove {self.text!r}, the working folder or a folder above it; point index.path at a folder of its own, such as runs/index"
                )
        if self.is_empty():
            return
        if not holds_index:
            raise ConfigError(
                f"index.overwrite=true removes only a Gradian index or an empty folder, and {self.text!r} holds something else ({', '.join(self.entries()[:3])}); move those files or choose another index.path"
            )
        if self.local is not None:
            # Every entry of an index is a zarr node: zarr.json, or a folder (array or group) with its own zarr.json.
            foreign = [
                p.name
                for p in sorted(self.local.iterdir())
                if p.name != "zarr.json" and not (p / "zarr.json").is_file()
            ]
            if foreign:
                raise ConfigError(
                    f"index.overwrite=true would remove {self.text!r}, which holds files that are not part of the index ({', '.join(foreign[:3])}); move them out or choose another index.path"
                )
        self.remove()

    def remove(self) -> None:
        """Delete whatever is stored here (a directory tree or a file)."""
        if self.local is not None:
            if self.local.is_dir():
                shutil.rmtree(self.local)
            else:
                self.local.unlink()
            return
        fs, path = self._filesystem()
        fs.rm(path, recursive=True)

    def bytes_on_disk(self) -> int:
        """Bytes stored under this location."""
        if self.local is not None:
            return sum(f.stat().st_size for f in self.local.rglob("*") if f.is_file())
        fs, path = self._filesystem()
        return int(fs.du(path, total=True))
