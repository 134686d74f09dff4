"""The one exception type users see.

Every message is a single line that names the setting, file or row at fault and says what to
change. `docs/troubleshooting.md` lists each one; `tests/test_docs.py` keeps that page complete.
"""


class GradianError(Exception):
    """A problem the user can fix: bad config, bad data, a mismatched index, an out-of-memory."""


class ConfigError(GradianError):
    """A setting is unknown, has the wrong type or an impossible value."""


class DataError(GradianError):
    """A data file is missing, unreadable, malformed or empty."""


class IndexFormatError(GradianError):
    """`index.path` holds something that is not a readable Gradian index."""


class IndexMismatchError(GradianError):
    """A query disagrees with the index it is scored against (model, modules, projection)."""


class DeviceOutOfMemoryError(GradianError):
    """The accelerator ran out of memory during indexing; the message says which setting to lower."""


class IndexWriteError(GradianError):
    """Writing the index failed part-way (a full disk); the rows already on disk are kept and a rerun resumes."""


class MissingExtraError(GradianError):
    """An optional feature was asked for without the extra that brings its package."""
