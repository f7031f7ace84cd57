"""A tiny progress bar for the benchmark scripts (no dependency).

    from _progress import progress
    for batch in progress(batches, desc="train", unit="step"):
        ...
    bar = progress(total=100, desc="reference")      # manual form
    bar.update(1, loss=f"{x:.3f}"); bar.close()

On a terminal it redraws one line on stderr (at most 10 times a second):
    reference  42/100 [#########...........]  42%  5.3 step/s  ETA 11s  loss=1.234
Elsewhere (a log, CI, pytest) it prints a plain line at 0%, every 25% and at the end, so logs
stay short. disable=True (or env TITANMAC_PROGRESS=0) prints nothing.
"""

import os
import sys
import time


def _fmt_time(seconds):
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    """An iterable wrapper and/or a manual counter with a text bar."""

    def __init__(self, iterable=None, total=None, desc="", unit="it", width=24, file=None,
                 disable=None, min_interval=0.1):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total = total
        self.desc = desc
        self.unit = unit
        self.width = width
        self.file = file or sys.stderr
        if disable is None:
            disable = os.environ.get("TITANMAC_PROGRESS", "1").strip() in ("0", "false", "no")
        self.disable = disable
        self.tty = bool(getattr(self.file, "isatty", lambda: False)())
        self.min_interval = min_interval
        self.n = 0
        self.postfix = ""
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._next_quarter = 0
        self._closed = False
        self._draw(force=True)

    # -- iteration --------------------------------------------------------------------------
    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- manual use -------------------------------------------------------------------------
    def update(self, n=1, **postfix):
        self.n += n
        if postfix:
            self.set_postfix(**postfix)
        self._draw()

    def set_postfix(self, **postfix):
        self.postfix = "  ".join(f"{k}={v}" for k, v in postfix.items())

    def write(self, text):
        """Print a line without breaking the bar."""
        if self.disable:
            print(text, file=self.file, flush=True)
            return
        if self.tty:
            self.file.write("\r\033[K")
        print(text, file=self.file, flush=True)
        self._draw(force=True)

    def close(self):
        if self._closed:
            return
        self._closed = True
        if self.disable:
            return
        if self.tty:
            self._draw(force=True)
            self.file.write("\n")
            self.file.flush()
        elif self._next_quarter <= 4:
            self.file.write(self._line() + "\n")
            self.file.flush()

    # -- drawing ----------------------------------------------------------------------------
    def _line(self):
        elapsed = time.perf_counter() - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        parts = [self.desc] if self.desc else []
        if self.total:
            frac = min(self.n / self.total, 1.0)
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            parts.append(f"{self.n}/{self.total} [{bar}] {frac * 100:3.0f}%")
        else:
            parts.append(f"{self.n} {self.unit}")
        parts.append(f"{rate:.2f} {self.unit}/s" if rate < 10 else f"{rate:.0f} {self.unit}/s")
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"ETA {_fmt_time((self.total - self.n) / rate)}")
        else:
            parts.append(f"{_fmt_time(elapsed)}")
        if self.postfix:
            parts.append(self.postfix)
        return "  ".join(parts)

    def _draw(self, force=False):
        if self.disable:
            return
        now = time.perf_counter()
        if self.tty:
            if force or now - self._last_draw >= self.min_interval or self.n == self.total:
                self._last_draw = now
                self.file.write("\r\033[K" + self._line())
                self.file.flush()
            return
        # not a terminal: a line at 0%, 25%, 50%, 75%, 100% (or every 25% of steps seen when
        # the total is unknown, only the first line and the close)
        if not self.total:
            if self._next_quarter == 0:
                self.file.write(self._line() + "\n")
                self.file.flush()
                self._next_quarter = 1
            return
        quarter = int(4 * self.n / self.total)
        if quarter >= self._next_quarter:
            self._next_quarter = quarter + 1
            self.file.write(self._line() + "\n")
            self.file.flush()


def progress(iterable=None, **kwargs):
    """progress(iterable, desc=..., total=..., unit=...) or progress(total=N) for manual use."""
    return Progress(iterable, **kwargs)
