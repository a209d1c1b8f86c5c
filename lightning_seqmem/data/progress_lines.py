"""Progress of long data work (tokenizing a split) as plain lines where no bar is drawn.

Where standard output is not a terminal the apps switch tqdm's bars off (``apps.console``): a log then gets no
carriage returns, but also no sign of life while a large split is tokenized. :class:`RowProgress` keeps the bar
where there is one, and otherwise says ``Tokenizing train: 120,000 of 1,000,000 rows (12%), 35 s`` every
``every_seconds``. No Lightning import.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["RowProgress"]


class RowProgress:
    """A tqdm bar over ``total`` rows, or, when tqdm's bars are off, a line every ``every_seconds`` (to ``say``)."""

    def __init__(self, total: int, desc: str, say: Callable[[str], None], every_seconds: float = 30.0) -> None:
        from datasets.utils.tqdm import tqdm

        self.bar = tqdm(total=total, unit=" rows", desc=desc)
        self.total, self.desc, self.say, self.every = total, desc, say, every_seconds
        self.done, self.start = 0, time.monotonic()
        self.last = self.start

    def __enter__(self) -> RowProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def update(self, rows: int) -> None:
        self.bar.update(rows)
        self.done += rows
        now = time.monotonic()
        if self.bar.disable and now - self.last >= self.every and self.done < self.total:
            self.last = now
            share = self.done / self.total if self.total else 1.0
            self.say(f"{self.desc}: {self.done:,} of {self.total:,} rows ({share:.0%}), {now - self.start:.0f} s")
