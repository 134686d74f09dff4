"""Ctrl-C inside a Lightning `Trainer` call, raised again as the KeyboardInterrupt it was.

Lightning catches KeyboardInterrupt itself (`_call_and_handle_interrupt`): it calls the callbacks'
`on_exception` (the indexer keeps its rows there), ignores SIGINT from then on, logs its own
"Detected KeyboardInterrupt" line and calls `sys.exit(1)`. Under `keyboard_interrupt()` that
SystemExit, which carries the KeyboardInterrupt as its context, becomes KeyboardInterrupt again,
Lightning's line is dropped and the SIGINT handler is put back: the `gradian` command then says
what was kept and exits 130 (cli.py), for `gradian index` (a validation loop) and `gradian validate`
(its training runs) alike.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import Iterator

# Lightning's rank-zero messages go to whichever of these two loggers was set up last.
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _NoInterruptLine(logging.Filter):
    """Drops Lightning's "Detected KeyboardInterrupt" line: gradian says what was kept instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Detected KeyboardInterrupt" not in str(record.msg)


@contextlib.contextmanager
def keyboard_interrupt() -> Iterator[None]:
    """Run a `Trainer.fit` / `Trainer.validate` call inside: Ctrl-C leaves it as KeyboardInterrupt (module docstring)."""
    handler = signal.getsignal(signal.SIGINT)
    quiet = _NoInterruptLine()
    loggers = [logging.getLogger(name) for name in RANK_ZERO_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    except SystemExit as err:
        if not isinstance(err.__context__, KeyboardInterrupt):
            raise
        raise KeyboardInterrupt from None
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
        if handler is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGINT, handler)
