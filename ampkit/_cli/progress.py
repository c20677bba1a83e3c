"""Progress over a series of runs: a tqdm bar on a terminal, plain periodic lines otherwise.

On a terminal each run gets a tqdm bar that stays as one finished line. Elsewhere (a log
file, CI, a pipe) a line is written when a run finishes and, for long runs, every
`PLAIN_EVERY_S` seconds in between, so the output never goes silent for minutes.
"""
import shutil
import sys
import time
from typing import Callable

from tqdm import tqdm

PLAIN_EVERY_S = 10.0  # seconds between plain lines within one run


class Progress:
    """``start(label)``, ``step(done)`` any number of times, ``finish()``; once per run."""

    def __init__(self, total_runs: int, steps: int, stream=None, clock: Callable[[], float] = time.perf_counter):
        self.total, self.steps = total_runs, steps
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.clock = clock
        self.run = 0
        self.bar = None

    def start(self, label: str) -> None:
        self.run += 1
        self.label = f"[{self.run:2d}/{self.total}] {label}"
        self.started = self.last_line = self.clock()
        if self.tty:
            size = shutil.get_terminal_size()  # 80x24 where the terminal reports 0x0 (tqdm would then hide the bar)
            self.bar = tqdm(total=self.steps, desc=self.label, unit="step", file=self.stream, leave=True,
                            ncols=size.columns, nrows=size.lines)

    def step(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif self.clock() - self.last_line >= PLAIN_EVERY_S:
            self._line(f"{done}/{self.steps} steps")

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        else:
            self._line(f"done in {self.clock() - self.started:.1f} s")

    def _line(self, text: str) -> None:
        self.last_line = self.clock()
        self.stream.write(f"{self.label}  {text}\n")
        self.stream.flush()
