"""A stand-in for a wandb run that keeps wandb's step rule, for the tests that read what a recipe gives wandb."""

from __future__ import annotations


class StrictRun:
    """A wandb run that keeps wandb's rule: ``log(step=s)`` after step ``s`` was committed is dropped."""

    def __init__(self):
        self.history: dict[int, dict] = {}
        self.dropped: list[tuple[int, list[str]]] = []
        self.current_step = 0
        self.summary = type("Summary", (), {"update": lambda self, values: None})()

    def log(self, data, step=None, commit=None):
        if step < self.current_step:
            self.dropped.append((step, sorted(data)))
            return
        self.history.setdefault(step, {}).update(data)
        if commit is not False:
            self.current_step = step + 1

    def finish(self):
        pass
