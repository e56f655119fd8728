"""A long command's progress on stderr (a fine-tuning run, a PDF's pages): tqdm's bar on a
terminal; plain lines where stderr is a file, a pipe or a CI log, which would otherwise
keep every redraw of the bar (a ``\\r`` line several times a second)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

# Plain progress: a line this often (and one at the end), besides the run's own lines
# (validation, checkpoints).
PLAIN_EVERY_S = 30.0


def say(line: str) -> None:
    """A line of the run's log, above the bar where there is one."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def progress(*, total: int, desc: str, unit: str, initial: int = 0, leave: bool = True,
             plain_every_s: float = PLAIN_EVERY_S):
    """A progress bar (``update``, ``set_postfix``, ``write``; a context manager);
    ``plain_every_s``: how often the plain lines come (0: at each update)."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, initial=initial, leave=leave,
                    dynamic_ncols=True, file=sys.stderr)
    return PlainProgress(total=total, desc=desc, unit=unit, initial=initial,
                         every_s=plain_every_s)


class PlainProgress:
    """tqdm's bar as a line every ``every_s`` seconds and at the end, in tqdm's words."""

    def __init__(self, *, total: int, desc: str, unit: str, initial: int = 0,
                 every_s: float = PLAIN_EVERY_S, file: TextIO | None = None):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self.start_n = self.shown_n = initial
        self.every_s = every_s
        self.file = file or sys.stderr
        self.started = self.last_line = time.monotonic()
        self.postfix: dict[str, Any] = {}
        self.closed = False

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = values

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last_line >= self.every_s:
            self._line(now)

    def write(self, line: str) -> None:
        print(line, file=self.file, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.n != self.shown_n:
                self._line(time.monotonic())

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self, now: float) -> None:
        from tqdm import tqdm

        self.last_line, self.shown_n = now, self.n
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        # Over this run's own items: a resumed run starts at `initial`.
        seconds, done = now - self.started, self.n - self.start_n
        rate = done / seconds if seconds > 0 else 0.0
        left = (self.total - self.n) / rate if rate > 0 else None
        timing = (f"{tqdm.format_interval(seconds)} elapsed, "
                  f"{tqdm.format_interval(left) if left is not None else '?'} left, "
                  f"{rate:.2f} {self.unit}s/s")
        postfix = "".join(f", {k}={v}" for k, v in self.postfix.items())
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}s{share}, {timing}{postfix}",
              file=self.file, flush=True)
