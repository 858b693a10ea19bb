"""Timing statistics and paired rounds, the state guard, and exact undo."""

from __future__ import annotations

import random
import time

import numpy as np
import torch

from torchtune_magic import perfcheck
from torchtune_magic.kernel import discovery, state
from torchtune_magic.kernel.fixes import Patcher
from torchtune_magic.measuring import timing
from torchtune_magic.render import text


def _runner(order: list[str], label: str, values: list[float], sleep_s: float = 0.0):
    """A configuration whose runs return `values` in turn (cycling), taking `sleep_s`."""

    def run() -> float:
        order.append(label)
        time.sleep(sleep_s)
        return values[(order.count(label) - 1) % len(values)]

    return run


def _unmetered() -> None:
    """The load meter for runners that return made-up times: the machine's load says
    nothing of them (a busy CI box would make the separation test wait for five rounds)."""
    return None


def test_paired_rounds_rotate_and_pair_each_fix_with_a_baseline_run():
    order: list[str] = []
    runners = {"base": _runner(order, "base", [1.0]), "fix": _runner(order, "fix", [0.5])}
    rounds = timing.paired_rounds(runners, "base", timing.Deadline(5.0), meter=_unmetered)
    # while the fix is undecided the baseline runs twice a round
    assert sorted(order[:3]) == sorted(order[3:6]) == ["base", "base", "fix"]
    assert rounds.ratios("fix") == [2.0] * len(rounds.rounds)
    assert rounds.noise() == [1.0] * len(rounds.rounds)  # the A/A ratios: no noise at all
    speedup = rounds.speedup("fix")
    assert speedup.verdict == "faster" and speedup.settled and speedup.by == "separation"
    assert len(rounds.rounds) == 3  # 2x against no noise: called at the first look allowed


def test_every_run_takes_a_place_in_its_round_drawn_anew_each_round():
    order: list[str] = []
    runners = {
        "base": _runner(order, "base", [1.0, 1.1]),
        "f1": _runner(order, "f1", [1.0, 0.9, 1.05]),
        "f2": _runner(order, "f2", [1.05, 0.95]),
    }
    timing.paired_rounds(runners, "base", timing.Deadline(0.5), begun=timing.Rounds("base", seed=7))
    taken = [order[:4], order[4:8]]  # two rounds: neither fix can be called before a third
    assert all(sorted(r) == ["base", "base", "f1", "f2"] for r in taken)
    assert taken[0] != taken[1]  # not one fixed order
    first = list(order)
    order.clear()
    timing.paired_rounds(runners, "base", timing.Deadline(0.5), begun=timing.Rounds("base", seed=7))
    assert order[:8] == first[:8]  # one seed, one draw: what every rank runs under torchrun
    # each measurement draws its own seed: a cell slower in some place of a round does
    # not get one pattern of places every time it is checked
    seeds = set()
    for _ in range(5):
        seeds.add(timing.paired_rounds(runners, "base", timing.Deadline(0.05)).seed)
    assert len(seeds) == 5


def test_a_settled_fix_drops_out_while_an_undecided_one_goes_on_until_the_deadline():
    order: list[str] = []
    runners = {
        "base": _runner(order, "base", [1.0], 0.01),
        "clear": _runner(order, "clear", [0.5], 0.01),
        "noise": _runner(order, "noise", [0.8, 1.25], 0.01),  # ratios 1.25, 0.8, ...: ~1
    }
    deadline = timing.Deadline(1.0)
    rounds = timing.paired_rounds(runners, "base", deadline, meter=_unmetered)
    assert rounds.speedup("clear").settled and not rounds.speedup("noise").settled
    assert order.count("clear") == 3 < order.count("noise")  # 2x: called in 3 rounds
    assert rounds.speedup("noise").verdict == "no clear change"  # straddles 1: never slower
    assert deadline.spent <= 1.0 + 0.05


def test_a_fix_clear_of_the_noise_runs_alone_until_it_settles():
    """A 3x fix's rounds time the baseline and it only, so it settles in three rounds of
    three runs; the small fix waits for those, then has the rounds left."""
    order: list[str] = []
    runners = {
        "base": _runner(order, "base", [1.0], 0.005),
        "big": _runner(order, "big", [0.33], 0.005),
        "small": _runner(order, "small", [0.97, 1.0], 0.005),
    }
    rounds = timing.paired_rounds(runners, "base", timing.Deadline(0.5), meter=_unmetered)
    assert rounds.speedup("big").settled and rounds.speedup("big").verdict == "faster"
    assert [sorted(r) for r in rounds.rounds[:3]] == [["base", "big", "small"]] + [
        ["base", "big"]
    ] * 2
    assert order.count("big") == 3 and order.count("small") > 1  # small: the rounds after
    assert all("big" not in r and "small" in r for r in rounds.rounds[3:])


def test_no_round_starts_that_would_end_past_the_deadline():
    order: list[str] = []
    runners = {"a": _runner(order, "a", [1.0, 1.3], 0.1), "b": _runner(order, "b", [1.2, 1.0], 0.1)}
    deadline = timing.Deadline(0.5)
    rounds = timing.paired_rounds(runners, "a", deadline, meter=_unmetered)
    assert len(rounds.rounds) == 1  # rounds take 0.3 s (a, b, a): a second would end at 0.6 s
    assert deadline.spent < 0.5


def test_measurement_flags_noise_and_one_time_cost():
    m = timing.Measurement("x", [1.0, 1.0, 1.5, 2.0, 1.0], warmup_s=3.0)
    assert m.median == 1.0 and m.noisy
    assert m.one_time_s == 2.0
    assert timing.Measurement("y", [1.0, 1.0], warmup_s=1.001).one_time_s is None


def test_zero_or_sub_microsecond_spread_is_never_noisy():
    """A cell with no torch work runs in a few µs: its jitter reads "± 0 µs" and is no
    noise; a real spread of 10% or more still is."""
    assert not timing.Measurement("still", [2e-6] * 5).noisy
    jitter = timing.Measurement("jitter", [2.0e-6, 2.4e-6, 2.0e-6, 2.5e-6, 2.1e-6])
    assert jitter.spread > 0.1 and not jitter.noisy
    assert timing.Measurement("noisy", [1e-3, 1.3e-3, 1e-3, 1.4e-3, 1.1e-3]).noisy
    report = perfcheck("x = 1\n", {}, budget=0.5)
    (baseline,) = [line for line in text.render(report).splitlines() if line.startswith("baseline")]
    assert not ("± 0 µs" in baseline and "(noisy)" in baseline)


def test_snapshot_restores_values_into_the_same_objects():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    loose = torch.zeros(3)
    ns = {"model": model, "opt": opt, "loose": loose}
    snap = state.take(ns, discovery.walk(ns))
    weight = model.weight.detach().clone()
    rng = (torch.get_rng_state(), random.random(), np.random.rand())

    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    loose += 1
    ns["new_name"] = 5
    ns["model"] = torch.nn.Linear(3, 2)
    snap.restore()

    assert ns["model"] is model and "new_name" not in ns
    assert torch.equal(model.weight, weight) and model.weight.grad is None
    assert len(opt.state) == 0 and torch.equal(loose, torch.zeros(3))
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert random.random() == rng[1] and np.random.rand() == rng[2]


def test_restores_between_runs_pass_over_tensors_the_cell_left_as_they_were():
    """A run that only reads `table` and trains `model`: between measuring runs the model
    is written back and the table is not touched (its version counter stays); a write to
    the table torch sees is restored after all, one it does not see (`.data`) is reported,
    and a full restore puts every tensor back."""
    model = torch.nn.Linear(3, 2)
    table = torch.arange(6.0)
    ns = {"model": model, "table": table}
    snap = state.take(ns, discovery.walk(ns))
    weight = model.weight.detach().clone()

    def run() -> None:  # the cell: reads the table, trains the model
        model(table[:3].unsqueeze(0)).sum().backward()
        with torch.no_grad():
            model.weight -= 0.1 * model.weight.grad

    run()
    snap.note_unwritten()
    read_version = table._version
    run()
    snap.restore(written_only=True)
    assert torch.equal(model.weight, weight) and model.weight.grad is None
    assert table._version == read_version  # not copied back: nothing wrote it

    table.mul_(2)  # a write torch sees: restored even so
    snap.restore(written_only=True)
    assert torch.equal(table, torch.arange(6.0)) and snap.written_unseen() == []

    table.data[0] = 99.0  # a write torch does not see: passed over, and said
    snap.restore(written_only=True)
    assert table[0] == 99.0 and snap.written_unseen() == [table]
    snap.restore()
    assert torch.equal(table, torch.arange(6.0)) and snap.written_unseen() == []


def test_discovery_finds_objects_behind_user_objects_closures_and_containers():
    model = torch.nn.Linear(2, 2)

    class Trainer:
        def __init__(self) -> None:
            self.parts = {"net": model}

    def make_step():
        def step():
            return model

        return step

    found = discovery.walk({"trainer": Trainer(), "step": make_step(), "models": [model]})
    paths = {str(loc) for loc in found[id(model)].locations}
    assert paths == {"trainer.parts['net']", "step<closure 0>", "models[0]"}


def test_patcher_undo_is_exact_even_for_instance_attributes():
    class Box:
        def method(self) -> str:
            return "class"

    box, ns = Box(), {"a": 1}
    patcher = Patcher()
    patcher.setattr(box, "method", lambda: "patched")
    patcher.setitem(ns, "a", 2)
    patcher.setitem(ns, "b", 3)
    assert box.method() == "patched" and ns == {"a": 2, "b": 3}
    patcher.undo()
    assert "method" not in vars(box) and box.method() == "class"
    assert ns == {"a": 1}


def test_discovery_searches_classes_defined_by_exec_without_a_module_name():
    ns: dict = {}
    exec("import torch\nclass Trainer:\n    pass\ntrainer = Trainer()\n", ns)
    model = torch.nn.Linear(2, 2)
    ns["trainer"].net = model  # Trainer.__module__ is "builtins" here
    found = discovery.walk(ns)
    assert [str(loc) for loc in found[id(model)].locations] == ["trainer.net"]


def test_patcher_switch_restores_a_torch_backend_flag():
    before = torch.backends.cudnn.benchmark
    patcher = Patcher()
    patcher.switch(torch.backends.cudnn, "benchmark", not before)
    assert torch.backends.cudnn.benchmark is (not before)
    patcher.undo()
    assert torch.backends.cudnn.benchmark is before
