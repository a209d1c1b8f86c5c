"""Tokenizing progress where no bar is drawn (a log file): a plain line at an interval, no carriage return."""

from lightning_seqmem.data.progress_lines import RowProgress


def test_a_log_gets_plain_lines_at_an_interval_when_bars_are_off(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")  # what apps.console sets where stdout is not a terminal
    said = []
    with RowProgress(1000, "Tokenizing train", said.append, every_seconds=0.0) as progress:
        for _ in range(4):
            progress.update(200)
    assert said[0].startswith("Tokenizing train: 200 of 1,000 rows (20%), ") and len(said) == 4
    assert not any("\r" in line or "\x1b[" in line for line in said)


def test_a_terminal_keeps_its_bar_and_gets_no_lines(monkeypatch):
    import importlib

    hf_tqdm = importlib.import_module("datasets.utils.tqdm")  # the module (datasets.utils.tqdm is also its class)

    drawn = []

    class Bar:  # a bar that is drawn (a terminal): what tqdm is when its bars are on
        disable = False

        def __init__(self, **kwargs):
            drawn.append(kwargs["desc"])

        def update(self, rows):
            drawn.append(rows)

        def close(self):
            pass

    monkeypatch.setattr(hf_tqdm, "tqdm", Bar)
    said = []
    with RowProgress(10, "Tokenizing train", said.append, every_seconds=0.0) as progress:
        progress.update(5)
    assert said == [] and drawn == ["Tokenizing train", 5]
