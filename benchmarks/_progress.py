"""A tiny progress bar for the benchmark scripts (no dependency).

    from _progress import progress, progress_rows
    for batch in progress(batches, desc="titanmac_c AdamW-mode: training", unit="step"):
        ...
    bar = progress(total=100, desc="reference: warm-up")     # manual form
    bar.update(1, loss=f"{x:.3f}"); bar.close()
    with progress_rows(["reference: timed steps", "titanmac_c: timed steps"], total=20) as rows:
        for _ in range(20):                                  # loops that alternate
            for row in rows: ...; row.update(1)

Each bar names the implementation and the phase it times. On a terminal a bar redraws one line
on stderr (at most 10 times a second); progress_rows keeps one line per bar:
    reference: warm-up  42/100 [##########..............]  42%  5.3 step/s  ETA 11s  loss=1.234
Elsewhere (a log, CI, pytest) each bar prints a plain line at 0%, every 25% and at the end, so
logs stay short. disable=True (or env TITANMAC_PROGRESS=0) prints nothing. Close a bar (or use
it as a context manager) before printing other lines, or print them with bar.write().
"""

import os
import shutil
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
                 disable=None, min_interval=0.1, position=0):
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
        self.position = position  # terminal line below the first bar's (progress_rows)
        self.in_rows = False      # a progress_rows bar: the rows end their lines together
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
            if not self.in_rows:  # progress_rows moves below its bars itself
                self.file.write("\n")
            self.file.flush()
        elif self._next_quarter <= 4:
            self.file.write(self._line() + "\n")
            self.file.flush()

    # -- drawing ----------------------------------------------------------------------------
    def _line(self, width=None):
        width = self.width if width is None else width
        elapsed = time.perf_counter() - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        parts = [self.desc] if self.desc else []
        if self.total:
            frac = min(self.n / self.total, 1.0)
            filled = int(frac * width)
            bar = "#" * filled + "." * (width - filled)
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
                # down to this bar's line and back up: the cursor rests on the first bar's line
                down, up = ("\n" * self.position, f"\033[{self.position}A") if self.position \
                    else ("", "")
                # within the terminal's width (a wrapped line would not be redrawn in place):
                # a shorter bar, then the line cut
                columns = shutil.get_terminal_size().columns - 1
                line = self._line()
                if len(line) > columns:
                    line = self._line(max(6, self.width - (len(line) - columns)))[:columns]
                self.file.write(down + "\r\033[K" + line + up)
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


class ProgressRows:
    """Bars for loops that alternate (implementations timed step by step in turn): one line
    each on a terminal, all closed together. Iterate over it, or index it, for the bars."""

    def __init__(self, descs, **kwargs):
        self.bars = []
        for i, desc in enumerate(descs):
            bar = Progress(desc=desc, position=i, **kwargs)
            bar.in_rows = True
            self.bars.append(bar)

    def __iter__(self):
        return iter(self.bars)

    def __getitem__(self, i):
        return self.bars[i]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        first = self.bars[0]
        open_before = not first._closed
        for bar in self.bars:
            bar.close()
        if open_before and first.tty and not first.disable:
            first.file.write("\n" * len(self.bars))  # below the last bar
            first.file.flush()


def progress_rows(descs, **kwargs):
    """ProgressRows: one bar per desc (total=..., unit=... shared), for alternating loops."""
    return ProgressRows(descs, **kwargs)
