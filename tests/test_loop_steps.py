"""Steps without modules or loaders: a raw-tensor training loop's iterations are its steps.

The cells here are written the way lecture notebooks write them (character-level language
models from raw tensors, hand-written layer classes, manual SGD, an early `break`): no
`nn.Module`, no DataLoader, no optimizer, so only the cell's own loop can mark its steps.
"""

from __future__ import annotations

import ast
import textwrap
import traceback

import pytest
import torch

from torchtune_magic import perfcheck, session
from torchtune_magic.cell import loops
from torchtune_magic.cell.workload import CellError, Workload
from torchtune_magic.probe import probe, steps
from torchtune_magic.probe.recorder import PROBE_MIN_STEPS, PROFILED_STEPS_MOST

RAW_SETUP = """
import torch
import torch.nn.functional as F
g = torch.Generator().manual_seed(2147483647)
Xtr = torch.randint(0, 27, (4000, 3), generator=g)
Ytr = torch.randint(0, 27, (4000,), generator=g)
C = torch.randn((27, 10), generator=g)
W1 = torch.randn((30, 64), generator=g) * 0.2
b1 = torch.randn(64, generator=g) * 0.01
W2 = torch.randn((64, 27), generator=g) * 0.01
b2 = torch.randn(27, generator=g) * 0
parameters = [C, W1, b1, W2, b2]
for p in parameters:
    p.requires_grad = True
"""

TRAIN = """
for i in range(max_steps):
    ix = torch.randint(0, Xtr.shape[0], (32,), generator=g)
    emb = C[Xtr[ix]]
    h = torch.tanh(emb.view(-1, 30) @ W1 + b1)
    logits = h @ W2 + b2
    loss = F.cross_entropy(logits, Ytr[ix])
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = 0.1 if i < 100000 else 0.01
    for p in parameters:
        p.data += -lr * p.grad
    if i >= stop_at:
        break
"""


def _namespace(**names: object) -> dict:
    ns: dict = {"__name__": "__main__", **names}
    exec(textwrap.dedent(RAW_SETUP), ns)
    return ns


def test_loops_are_the_cells_own_and_keep_their_key_when_lines_move():
    cell = textwrap.dedent(
        """
        def helper():
            for j in range(3):
                pass
        for epoch in range(2):
            for i in range(n):
                helper()
        while True:
            break
        """
    )
    found = loops.loops_of(ast.parse(cell))
    assert [loop.header for loop in found] == [
        "for epoch in range(2)",
        "for i in range(n)",
        "while True",
    ]  # the helper's loop is the function's, not the cell's
    assert [loop.depth for loop in found] == [0, 1, 0]
    moved = loops.loops_of(ast.parse("import torch\n\n" + cell))
    assert [loop.key for loop in moved] == [loop.key for loop in found]
    assert [loop.line for loop in moved] == [loop.line + 2 for loop in found]


def test_an_instrumented_cell_keeps_the_editors_line_numbers():
    workload = Workload("\n\nfor i in range(3):\n    x = 1\n    y = 1 / (i - 2)\n", {})
    key = loops.loops_of(workload.tree)[0].key
    seen: list[str] = []
    with pytest.raises(CellError) as raised, loops.listening(seen.append):
        workload.run(loop_keys=frozenset({key}))
    assert seen == [key] * 3  # one call per iteration begun
    frame = traceback.extract_tb(raised.value.original.__traceback__)[-1]
    assert frame.lineno == 5  # the division, as the editor numbers it
    assert loops.HOOK not in workload.namespace  # bound for the run only


def test_the_probe_finds_the_training_loop_and_counts_the_iterations_that_ran():
    ns = _namespace(max_steps=200000, stop_at=40)
    obs = probe.run(Workload(textwrap.dedent(TRAIN), ns), "cpu")
    trace = obs.leading_step()
    assert trace is not None and trace.unit == "iteration"
    assert trace.obj.header == "for i in range(max_steps)"  # the loop around backward,
    assert trace.count == 41  # not the `for p in parameters` loops; the break counted
    count = steps.count_steps(obs, trace)
    assert count.total == 41


def test_a_probe_stopped_at_its_first_chance_still_takes_the_training_loop_for_the_step():
    # a slow first iteration (a busy machine, the profiler starting) lets the probe's time
    # run out inside it, in the loop over the parameters that comes before the backward
    ns = _namespace(max_steps=200000, stop_at=40)
    obs = probe.run(Workload(textwrap.dedent(TRAIN), ns), "cpu", stop_after_s=0.0)
    assert obs.stopped_early
    trace = obs.leading_step()
    assert trace is not None and trace.obj.header == "for i in range(max_steps)"
    assert trace.count == PROBE_MIN_STEPS
    count = steps.count_steps(obs, trace)
    assert count.total == 41, count


def test_the_profiler_covers_a_few_dozen_steps_of_a_loop_of_small_ops_not_seconds_of_them():
    # every profiled op is paid for when the profiler stops and its events are read back:
    # a raw-tensor loop profiled for seconds made the probe take 9 s of a 3 s bound
    ns = _namespace(max_steps=200000, stop_at=400)
    obs = probe.run(Workload(textwrap.dedent(TRAIN), ns), "cpu", profile_for_s=60.0)
    assert not obs.stopped_early and obs.leading_step().count == 401
    assert obs.profiled_s is not None  # our profiler stopped before the cell ended
    # one tanh a step: the op stream holds the profiled steps' ops, not the cell's 401
    tanhs = sum(op.name == "aten::tanh" for op in obs.ops or [])
    assert PROFILED_STEPS_MOST - 1 <= tanhs <= PROFILED_STEPS_MOST + 1, tanhs


@pytest.mark.parametrize(
    ("cell", "total"),
    [
        ("for i in range(200000):\n    x = 1\n    if i >= 1000:\n        break\n", 1001),
        ("for i in range(10, 500, 5):\n    if i == 100:\n        break\n", 19),
        ("for i in range(50):\n    if i > 1000:\n        break\n", 50),  # never met
        ("for i, x in enumerate(items):\n    if i >= 1:\n        break\n", 2),
        ("for step in range(n):\n    if 30 <= step:\n        break\n", 31),
    ],
)
def test_an_early_break_on_the_loop_index_counts_the_iterations_that_run(cell, total):
    count, parts = steps.loop_total(ast.parse(cell), 2, {"items": [1, 2, 3], "n": 99})
    assert count == total, parts


def test_a_break_on_anything_else_makes_the_count_unknown_and_says_where():
    cell = "for i in range(1000):\n    loss = f(i)\n    if loss < 0.1:\n        break\n"
    count, parts = steps.loop_total(ast.parse(cell), 2, {})
    assert count is None
    assert "the `break` at cell line 4 can end `for i in range(1000)`" in parts[0]


def test_a_long_raw_tensor_cell_is_sampled_by_its_iterations_and_ends_as_one_plain_run(
    monkeypatch: pytest.MonkeyPatch,
):
    # the probe stops after half a second (users get 3-8 s): the cell is "long" whatever
    # the machine's speed
    monkeypatch.setattr(session, "PROBE_SECONDS", (0.5, 0.5))
    setup = dict(max_steps=200000, stop_at=1500)
    plain = _namespace(**setup)
    exec(textwrap.dedent(TRAIN), plain)
    ns = _namespace(**setup)
    report = perfcheck(TRAIN, ns, budget=6)
    sampling = report.sampling
    assert sampling is not None and sampling.unit == "iteration"
    assert sampling.steps_per_run == 1501
    assert "ended by the break at cell line 15" in sampling.steps_detail
    assert not sampling.probe_complete and sampling.stop_step < 1501
    assert report.cell_run is not None and report.cell_run.status == "complete"
    assert report.cell_run.steps == 1501
    for name in ("C", "W1", "b1", "W2", "b2"):
        assert torch.equal(ns[name], plain[name]), name  # as after one plain run
    assert ns["i"] == plain["i"] == 1500
    assert torch.equal(ns["g"].get_state(), plain["g"].get_state())
