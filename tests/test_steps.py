"""How many steps one complete run has, worked out from the cell's own loops (the probe of a
long cell stops early, so the count cannot always be taken from a whole run)."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchtune_magic.probe import steps


def _total(cell: str, line: int, namespace: dict, **kwargs) -> tuple[int | None, list[str]]:
    return steps.loop_total(ast.parse(textwrap.dedent(cell)), line, namespace, **kwargs)


@pytest.fixture
def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(96, 2)), batch_size=8)  # 12 batches


def test_epochs_around_a_loop_over_the_loader(loader: DataLoader) -> None:
    cell = """
    for epoch in range(epochs):
        for x, in loader:
            pass
    """
    total, parts = _total(cell, 3, {"epochs": 8, "loader": loader}, per_pass=12, iterated=loader)
    assert total == 96
    assert parts == ["8 x `range(epochs)` (cell line 2)"]  # the loader's own loop is per_pass


@pytest.mark.parametrize(
    ("loop", "trips"),
    [
        ("range(2, n * 3, 2)", 5),  # arithmetic on names, start and step
        ("tqdm(range(n))", 4),  # wrappers that pass through
        ("enumerate(items)", 3),
        ("zip(items, range(10))", 3),
        ("range(cfg.epochs)", 7),  # an attribute chain
        ("range(len(items) - 1)", 2),
    ],
)
def test_loop_trip_counts(loop: str, trips: int) -> None:
    class Config:
        epochs = 7

    cell = f"for i in {loop}:\n    opt.step()\n"
    namespace = {"n": 4, "items": ["a", "b", "c"], "cfg": Config()}
    total, _ = _total(cell, 2, namespace)
    assert total == trips


def test_a_step_issued_through_a_call_counts_the_loops_around_the_call() -> None:
    cell = """
    for epoch in range(3):
        train_one_epoch(model, loader)
    """
    assert _total(cell, 3, {}, per_pass=12)[0] == 36


def test_loops_inside_functions_the_cell_defines_are_not_the_cells() -> None:
    cell = """
    def helper():
        for i in range(100):
            pass
    for i in range(5):
        helper()
    """
    assert _total(cell, 6, {})[0] == 5


@pytest.mark.parametrize(
    ("cell", "why"),
    [
        ("while not done:\n    opt.step()\n", "a while loop at cell line 1"),
        ("for x in stream():\n    opt.step()\n", "`for … in stream()` at cell line 1"),
        ("for i in range(n_unknown):\n    opt.step()\n", "range(n_unknown)"),
    ],
)
def test_unknown_counts_say_why(cell: str, why: str) -> None:
    total, parts = _total(cell, 2, {})
    assert total is None and why in parts[0]


def test_the_stop_step_fits_the_budget_and_never_passes_the_last_step() -> None:
    # 2 configurations, 1 s to step W=2, then 0.1 s a step: 6 rounds of 3 runs (the
    # baseline closes each round) in 48 s
    assert steps.TARGET_ROUNDS == 6
    stop = steps.choose_stop(48.0, 2, lead_s=1.0, step_s=0.1, warmup=2, total=None)
    assert stop == 2 + 16  # (48 / (3 x 6) - 1) / 0.1 = 16.7 timed steps
    assert steps.choose_stop(48.0, 2, 1.0, 0.1, 2, total=9) == 8  # stops before the end
    tight = steps.choose_stop(1.0, 4, 1.0, 0.1, warmup=8, total=None, min_timed=8)
    assert tight == 16  # never fewer timed steps than asked, even over budget


def test_warmup_covers_a_loaders_prefetch_burst() -> None:
    assert steps.warmup_for(None) == steps.WARMUP_STEPS
    assert steps.warmup_for(None, steps.prefetch_depth(4, None)) == 8  # 4 workers x 2
    assert steps.warmup_for(4) == 1  # no room for two warm-up steps and three timed ones
    assert steps.prefetch_depth(0, None) == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_whose_epoch_is_longer_than_its_timed_steps_ends_that_epoch_early(
    workers: int,
) -> None:
    """The cut ends the epoch the way the loader ends any (its workers' prefetched batches
    handed out first), the cell's own loop goes on to its next epoch, and the restart's
    cost (here a 0.25 s worker start, or nothing in the main process) is timed apart from
    the steady steps."""
    from slow_data import SlowDataset, slow_worker_start

    loader = DataLoader(
        SlowDataset(60, delay_s=0.0),
        batch_size=2,
        num_workers=workers,
        worker_init_fn=slow_worker_start if workers else None,
    )
    plan = steps.SamplePlan(
        steps.StepSource("batch", "loader", loader.dataset),
        warmup=4,
        stop=14,
        min_timed=3 + 4,
        per_epoch=len(loader),
        settle=4,
    )
    assert plan.epoch_end == 10  # 3+ timed steps before the restart, `settle` after it
    counter = steps.StepCounter(plan.source, warmup=4, stop=14, epoch_end=plan.epoch_end)
    seen: list[tuple[int, int]] = []
    with counter.counting() as times, pytest.raises(steps.StepLimitReached):
        for epoch in range(3):
            for i, _ in enumerate(loader):
                seen.append((epoch, i))
    assert seen == [(0, i) for i in range(10)] + [(1, i) for i in range(4)]
    assert (times.turn_count, times.turns, times.count) == (10, 1, 14)
    restart = times.restart(plan.warmup)
    assert restart is not None
    if workers:
        assert restart > 0.2  # the new workers' start
        assert times.per_step(4, per_epoch=30) > restart / 30
    else:
        assert restart < 0.1
    assert sum(1 for _ in loader) == 30  # the loader itself is left whole
