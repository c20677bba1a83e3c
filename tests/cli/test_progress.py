"""ampkit.progress: tqdm bars on a terminal, plain periodic lines elsewhere."""
import io

from ampkit._cli.progress import PLAIN_EVERY_S, Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_plain_output_has_a_line_per_run_and_periodic_lines_in_long_runs():
    out, clock = io.StringIO(), Clock()
    bar = Progress(total_runs=2, steps=30, stream=out, clock=clock)
    bar.start("lm  O0")
    for done in range(1, 31):
        clock.now += 1.0  # 30 s in all: three periodic lines
        bar.step(done)
    bar.finish()
    bar.start("lm  O5")
    clock.now += 2.5
    bar.step(1)  # a short run: no periodic line
    bar.finish()
    lines = out.getvalue().splitlines()
    every = int(PLAIN_EVERY_S)
    assert lines == [f"[ 1/2] lm  O0  {n}/30 steps" for n in (every, 2 * every, 3 * every)] + [
        "[ 1/2] lm  O0  done in 30.0 s",
        "[ 2/2] lm  O5  done in 2.5 s",
    ]
    assert "\r" not in out.getvalue() and "\033" not in out.getvalue()


def test_terminal_output_is_a_tqdm_bar_per_run():
    out = Terminal()
    bar = Progress(total_runs=1, steps=4, stream=out)
    bar.start("cnn O2")
    for done in (1, 3, 4):  # reports may skip steps; the bar follows the count
        bar.step(done)
    assert bar.bar.n == 4
    bar.finish()
    text = out.getvalue()
    assert "[ 1/1] cnn O2" in text and "4/4" in text and "100%" in text
    assert bar.bar is None and "done in" not in text
