"""A plain-text progress bar for stderr (no dependencies): done/total, tokens/s, ETA.

On a terminal it redraws one line (``\\r``) at most ``hz`` times a second; otherwise (logs, CI) it
prints a full line every ``log_every_s`` seconds. ``close()`` prints the final line. Pure apart
from writing to the given stream; the clock is injectable for tests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def format_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "--:--"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def render(done: int, total: int, tokens: int, elapsed: float, done_at_start: int = 0, width: int = 24,
           label: str = "") -> str:
    """One progress line. Rates count only work done in this run (``done - done_at_start``)."""
    frac = done / total if total else 1.0
    fill = int(round(frac * width))
    bar = "#" * fill + "." * (width - fill)
    new = done - done_at_start
    tps = tokens / elapsed if elapsed > 0 else 0.0
    eta = (total - done) * elapsed / new if new > 0 else None
    if done >= total:
        eta = 0.0
    head = f"{label} " if label else ""
    return f"{head}[{bar}] {done}/{total} {frac * 100:5.1f}% {tps:8.1f} tok/s ETA {format_eta(eta)}"


class ProgressBar:
    def __init__(self, total: int, done: int = 0, *, stream: TextIO | None = None, label: str = "",
                 hz: float = 4.0, log_every_s: float = 5.0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.done = done
        self.done_at_start = done
        self.tokens = 0
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.enabled = enabled
        self.clock = clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 1.0 / hz if self.tty else log_every_s
        self.start = clock()
        self._last = -1e18

    def update(self, done: int = 1, tokens: int = 0) -> None:
        self.done += done
        self.tokens += tokens
        now = self.clock()
        if now - self._last >= self.interval:
            self._draw(now)

    def line(self) -> str:
        return render(self.done, self.total, self.tokens, self.clock() - self.start, self.done_at_start, label=self.label)

    def _draw(self, now: float, final: bool = False) -> None:
        if not self.enabled:
            return
        self._last = now
        text = render(self.done, self.total, self.tokens, now - self.start, self.done_at_start, label=self.label)
        if self.tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._draw(self.clock(), final=True)
