"""A small dependency-free progress bar on stderr (offline quantization runs for minutes on big models)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")

BAR_WIDTH = 24


def progress(
    items: Iterable[T],
    *,
    desc: str,
    total: int | None = None,
    enabled: bool = True,
    stream: TextIO | None = None,
) -> Iterator[T]:
    """Yields ``items`` while drawing ``desc [#####.....] i/total elapsed`` on one stderr line.

    ``total`` defaults to ``len(items)`` when it has one (otherwise only the count is shown). The line
    is redrawn in place with a carriage return and finished with a newline; ``enabled=False`` yields
    the items untouched and prints nothing.
    """
    if not enabled:
        yield from items
        return
    stream = sys.stderr if stream is None else stream
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    start = time.perf_counter()

    def draw(done: int) -> None:
        elapsed = time.perf_counter() - start
        if total:
            filled = BAR_WIDTH * done // total
            bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total}"
        else:
            bar = f"{done}"
        stream.write(f"\r{desc} {bar} {elapsed:6.1f}s")
        stream.flush()

    done = 0
    draw(done)
    try:
        for item in items:
            yield item
            done += 1
            draw(done)
    finally:
        stream.write("\n")
        stream.flush()
