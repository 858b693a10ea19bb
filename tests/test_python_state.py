"""Plain Python state a cell changes in place ends as after one plain run of the cell: lists
it appends to, counters, deques, numpy arrays, hand-written layers' attributes, closure
cells, class attributes and random generators are written back into the same objects.
What cannot be put back (a generator advanced, a file written) is named, and so is what
the snapshot's bounds leave out."""

from __future__ import annotations

import array
import collections
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from workloads import namespace_with

from torchtune_magic.kernel import discovery, pystate, state

MAKEMORE_SETUP = """
import collections
import numpy as np
import torch
g = torch.Generator().manual_seed(2147483647)

class Linear:
    def __init__(self, fan_in, fan_out):
        self.weight = torch.randn((fan_in, fan_out), generator=g) / fan_in**0.5
    def __call__(self, x):
        self.out = x @ self.weight
        return self.out
    def parameters(self):
        return [self.weight]

class BatchNorm1d:
    calls = 0
    def __init__(self, dim, momentum=0.1):
        self.momentum = momentum
        self.gamma, self.beta = torch.ones(dim), torch.zeros(dim)
        self.running_mean, self.running_var = torch.zeros(dim), torch.ones(dim)
    def __call__(self, x):
        BatchNorm1d.calls += 1
        xmean, xvar = x.mean(0, keepdim=True), x.var(0, keepdim=True)
        self.out = self.gamma * (x - xmean) / torch.sqrt(xvar + 1e-5) + self.beta
        with torch.no_grad():
            self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * xmean
            self.running_var = (1 - self.momentum) * self.running_var + self.momentum * xvar
        return self.out
    def parameters(self):
        return [self.gamma, self.beta]

class Tanh:
    def __call__(self, x):
        self.out = torch.tanh(x)
        return self.out
    def parameters(self):
        return []

def make_counter():
    seen = 0
    def count():
        nonlocal seen
        seen += 1
        return seen
    return count

layers = [Linear(6, 16), BatchNorm1d(16), Tanh(), Linear(16, 4)]
parameters = [p for layer in layers for p in layer.parameters()]
for p in parameters:
    p.requires_grad = True
X = torch.randn(64, 6, generator=g)
Y = torch.randint(0, 4, (64,), generator=g)
lossi = []
tokens = collections.Counter()
recent = collections.deque(maxlen=3)
hist = np.zeros(4)
count = make_counter()
"""

TRAIN_CELL = """\
for i in range(30):
    ix = torch.randint(0, X.shape[0], (8,), generator=g)
    x = X[ix]
    for layer in layers:
        x = layer(x)
    loss = torch.nn.functional.cross_entropy(x, Y[ix])
    for p in parameters:
        p.grad = None
    loss.backward()
    for p in parameters:
        p.data += -0.1 * p.grad
    lossi.append(loss.item())
    tokens.update(Y[ix].tolist())
    recent.append(count())
    hist += np.bincount(Y[ix].numpy(), minlength=4)
"""

TRACKED = ("lossi", "tokens", "recent", "hist", "layers", "g", "count")


def _user_state(ns: dict[str, Any]) -> dict[str, Any]:
    """What the training cell changes, as comparable values."""
    layers = ns["layers"]
    return {
        "lossi": list(ns["lossi"]),
        "tokens": dict(ns["tokens"]),
        "recent": (list(ns["recent"]), ns["recent"].maxlen),
        "hist": ns["hist"].tolist(),
        "generator": ns["g"].get_state(),
        "counted": ns["count"].__closure__[0].cell_contents,
        "bn calls": type(layers[1]).calls,
        "layer attributes": [sorted(vars(layer)) for layer in layers],
        "tensors": [
            (i, name, value.detach().clone())
            for i, layer in enumerate(layers)
            for name, value in sorted(vars(layer).items())
            if isinstance(value, torch.Tensor)
        ],
    }


def _assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        if key in ("generator", "tensors"):
            continue
        assert actual[key] == expected[key], key
    assert torch.equal(actual["generator"], expected["generator"])
    assert [(i, n) for i, n, _ in actual["tensors"]] == [(i, n) for i, n, _ in expected["tensors"]]
    for (i, name, got), (_, _, want) in zip(actual["tensors"], expected["tensors"], strict=True):
        assert torch.equal(got, want), f"layers[{i}].{name}"


def test_perfcheck_in_a_shell_leaves_python_state_as_one_plain_run(ip):
    """The makemore lecture's pattern: a training cell appends to `lossi` made in an
    earlier cell, hand-written layers rebind `self.out` and their running statistics. After
    %%perfcheck ran it many times, everything equals one plain run's result, in the same
    container objects."""
    plain = namespace_with(MAKEMORE_SETUP)
    exec(TRAIN_CELL, plain)
    expected = _user_state(plain)
    assert len(expected["lossi"]) == 30 and expected["bn calls"] == 30

    assert ip.run_cell(MAKEMORE_SETUP).error_in_exec is None
    before = {name: ip.user_ns[name] for name in TRACKED}
    result = ip.run_cell(f"%%perfcheck -o --budget 2 --no-widget -q\n{TRAIN_CELL}")
    assert result.error_in_exec is None
    report = result.result
    assert report.baseline.runs >= 2  # the cell really ran many more times than once

    _assert_same(_user_state(ip.user_ns), expected)
    for name, obj in before.items():
        assert ip.user_ns[name] is obj, name  # the same objects, written back into
    assert not [w for w in report.warnings if "not snapshotted" in w or "stopped at" in w]


def _take(ns: dict[str, Any], cell: str | None = None) -> state.Snapshot:
    return state.take(ns, discovery.walk(ns), cell)


def test_containers_are_restored_in_place_with_their_kind_and_order():
    items = [1, [2, 3]]
    ordered = collections.OrderedDict(a=1, b=2, c=3)
    grouped: collections.defaultdict[str, list[int]] = collections.defaultdict(list, x=[1])
    counts = collections.Counter("abca")
    seen = {1, 2}
    recent = collections.deque([1, 2, 3], maxlen=3)
    raw = bytearray(b"abc")
    doubles = array.array("d", [0.0, 1.5])
    ns = {
        "items": items, "ordered": ordered, "grouped": grouped, "counts": counts,
        "seen": seen, "recent": recent, "raw": raw, "doubles": doubles,
    }  # fmt: skip
    alias = items[1]
    snapshot = _take(ns)

    items.append(4)
    alias.append(99)  # a nested list held elsewhere too
    ordered.move_to_end("a")
    ordered["d"] = 4
    grouped["y"].append(2)
    grouped.default_factory = set
    counts.update("zz")
    seen.discard(1)
    seen.add(7)
    recent.append(4)
    raw.extend(b"def")
    raw[0] = ord("X")
    doubles[0] = -0.0
    doubles.append(2.0)
    snapshot.restore()

    assert items == [1, [2, 3]] and items[1] is alias
    assert list(ordered.items()) == [("a", 1), ("b", 2), ("c", 3)]
    assert dict(grouped) == {"x": [1]} and grouped.default_factory is list
    assert counts == collections.Counter("abca") and isinstance(counts, collections.Counter)
    assert seen == {1, 2}
    assert list(recent) == [1, 2, 3] and recent.maxlen == 3
    assert raw == bytearray(b"abc")
    assert doubles.tobytes() == array.array("d", [0.0, 1.5]).tobytes()  # +0.0, not -0.0
    for name, obj in ns.items():
        assert ns[name] is obj


def test_numpy_arrays_and_tensors_held_in_containers_get_their_values_back():
    values = np.arange(6.0)
    boxes = np.empty(2, dtype=object)
    first = [1]
    boxes[0], boxes[1] = first, "x"
    deep = torch.zeros(3)
    ns = {"values": values, "boxes": boxes, "nested": {"a": {"b": {"c": {"d": [deep]}}}}}
    snapshot = _take(ns)
    assert any(t.tensor is deep for t in snapshot.tensors)  # deeper than discovery looks
    assert len({id(t.tensor) for t in snapshot.tensors}) == len(snapshot.tensors)

    values *= 2
    values.shape = (2, 3)
    boxes[0] = "replaced"
    first.append(2)
    deep.add_(5)
    snapshot.restore()

    assert values.shape == (6,) and np.array_equal(values, np.arange(6.0))
    assert boxes[0] is first and first == [1]
    assert torch.equal(deep, torch.zeros(3))


def test_a_tensor_found_by_discovery_and_in_a_list_is_snapshotted_once():
    weight = torch.ones(2)
    ns = {"weight": weight, "params": [weight], "holder": {"w": weight}}
    snapshot = _take(ns)
    assert [id(t.tensor) for t in snapshot.tensors] == [id(weight)]


class Layer:
    """A hand-written layer, as in the makemore lectures (not an nn.Module)."""

    made = 0

    def __init__(self) -> None:
        Layer.made += 1
        self.running_mean = torch.zeros(2)


class Point:
    __slots__ = ("__z", "x", "y")  # `__z` is stored as `_Point__z`

    def __init__(self) -> None:
        self.x = 1


class Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.out = self.linear(x)
        return self.out


MAKE_STEP = """
def make():
    calls = 0
    def step():
        nonlocal calls
        calls += 1
        return calls
    return step
step = make()
"""


def test_attributes_slots_module_attributes_closures_and_class_attributes():
    layer, point, model = Layer(), Point(), Counted()
    mean = layer.running_mean
    ns = namespace_with(MAKE_STEP, __name__=__name__, layer=layer, point=point, model=model)
    step = ns["step"]
    made = Layer.made
    snapshot = _take(ns)
    internals = {k: v for k, v in vars(model).items() if k.startswith("_")}

    layer.running_mean = 0.9 * layer.running_mean + 0.1  # rebound, not written in place
    layer.out = torch.ones(1)
    point.x, point.y, point._Point__z = 5, 6, 7
    model(torch.randn(1, 2))
    model.eval()
    step()
    Layer()
    snapshot.restore()

    assert layer.running_mean is mean and not hasattr(layer, "out")
    assert point.x == 1 and not hasattr(point, "y") and not hasattr(point, "_Point__z")
    assert model.calls == 0 and not hasattr(model, "out") and model.training
    assert {k: v for k, v in vars(model).items() if k.startswith("_")} == internals
    assert step.__closure__[0].cell_contents == 0
    assert Layer.made == made


def test_random_generators_anywhere_get_their_state_back():
    class Holder:
        def __init__(self) -> None:
            self.generators = {"deep": {"er": {"still": [torch.Generator().manual_seed(1)]}}}

    rng, np_gen, np_state = random.Random(1), np.random.default_rng(1), np.random.RandomState(1)
    holder = Holder()
    torch_gen = holder.generators["deep"]["er"]["still"][0]
    ns = {"rng": rng, "np_gen": np_gen, "np_state": np_state, "holder": holder}
    snapshot = _take(ns)
    expected = (rng.random(), np_gen.random(), np_state.rand(), torch.rand(1, generator=torch_gen))
    snapshot.restore()
    again = (rng.random(), np_gen.random(), np_state.rand(), torch.rand(1, generator=torch_gen))
    assert again[:3] == expected[:3] and torch.equal(again[3], expected[3])


def test_a_list_too_big_for_the_bound_is_not_copied_and_is_named():
    big, small = list(range(50)), [1, 2]
    snap = pystate.take({"big": big, "small": small}, bounds=pystate.Bounds(references=10))
    (said,) = snap.not_covered
    assert said.startswith("`big` (a list of 50 items) was not snapshotted")
    big.append(1)
    small.append(3)
    snap.restore()
    assert len(big) == 51 and small == [1, 2]  # what fits is still restored


def test_the_names_the_cell_reads_are_covered_first_when_a_bound_stops_the_walk():
    ns: dict[str, Any] = {f"other{i}": [[i]] for i in range(20)}
    ns["helper"] = None

    # the cell calls `train`, whose code reads `lossi`: both come before the other names
    exec("def train():\n    lossi.append(1)\n", ns)
    ns["lossi"] = []
    reads = pystate.cell_reads("train()\n", ns)
    assert reads == ["train", "lossi"]
    # through a notebook class's methods too: calling `model` reads the global `scale`
    exec("class Model:\n    def __call__(self, x):\n        return x * scale[0]\n", ns)
    ns["model"], ns["scale"] = ns["Model"](), [2]
    assert pystate.cell_reads("y = model(1)\n", ns) == ["model", "scale"]
    snap = pystate.take(ns, reads, bounds=pystate.Bounds(objects=5))
    (said,) = snap.not_covered
    assert "stopped at its bound of 5 objects" in said and "`other" in said
    assert "`lossi`" not in said and "`train`" not in said
    ns["train"]()
    snap.restore()
    assert ns["lossi"] == []


def test_a_big_dataset_the_cell_reads_does_not_use_up_the_bounds_before_lossi():
    """The walk goes breadth first: `lossi` is taken before the dataset's rows."""
    ns = {"dataset": [[i] for i in range(100)], "lossi": []}
    cell = "for row in dataset:\n    lossi.append(row[0])\n"
    reads = pystate.cell_reads(cell, ns)
    assert reads == ["dataset", "lossi"]
    snap = pystate.take(ns, reads, bounds=pystate.Bounds(objects=20))
    (said,) = snap.not_covered
    assert (
        "stopped at its bound of 20 objects: some objects reachable from `dataset` were left"
        in said
    )
    exec(cell, ns)
    snap.restore()
    assert ns["lossi"] == []


def test_a_walk_past_its_time_bound_names_what_it_left():
    ns = {f"name{i}": [[i] for _ in range(50)] for i in range(200)}
    started = time.perf_counter()
    snap = pystate.take(ns, bounds=pystate.Bounds(seconds=0.001))
    assert time.perf_counter() - started < 0.5
    (said,) = snap.not_covered
    assert "stopped at its bound of 0.001 s" in said and "more" in said


def test_generators_iterators_and_files_the_cell_advances_are_named(tmp_path: Path):
    def numbers():
        yield from range(100)

    log = (tmp_path / "log.txt").open("w")
    source = tmp_path / "in.txt"
    source.write_text("a\nb\n")
    reader = source.open()
    ns = {
        "batches": numbers(), "untouched": numbers(), "words": iter(["a", "b", "c"]),
        "log": log, "reader": reader, "spare": numbers(),
    }  # fmt: skip
    cell = "next(batches)\nnext(words)\nlog.write('x')\nreader.readline()\nuntouched\n"
    snapshot = _take(ns, cell)
    exec(cell, ns)
    ns["spare"].__next__()  # advanced, but the cell does not read it: not watched

    changes = snapshot.unrestorable_changes()
    assert len(changes) == 4, changes
    generator, iterator, written, read = changes
    assert generator == (
        "`batches` (a generator bound before the cell) was advanced by the cell: it cannot "
        "be rewound, so re-running the cell would consume more of it"
    )
    assert iterator.startswith("`words` (an iterator bound before the cell) was advanced")
    assert written.startswith("`log` (a file open for writing) was written by the cell")
    assert read.startswith("`reader` (a file open for reading) was read by the cell")
    log.close()
    reader.close()


def test_an_iterator_whose_position_cannot_be_read_is_named_all_the_same():
    import csv
    import io

    rows = csv.reader(io.StringIO("a\nb\n"))  # no length hint, no pickled state
    snapshot = _take({"rows": rows}, "header = rows\n")
    (said,) = snapshot.unrestorable_changes()
    assert said.startswith(
        "`rows` (an iterator bound before the cell) has a position perfcheck cannot read"
    )


def test_a_generator_the_cell_only_reads_about_is_not_named():
    def numbers():
        yield from range(3)

    batches = numbers()
    next(batches)
    ns = {"batches": batches, "done": iter([])}
    snapshot = _take(ns, "print(batches, done)\nlist(done)\n")
    exec("text = repr(batches)\nlist(done)\n", ns)
    assert snapshot.unrestorable_changes() == []


def test_restores_between_runs_pass_over_containers_the_run_left_and_say_unseen_writes():
    """`words` is only read by the cell: between measuring runs it is not written back
    while its length and ends stay; an item replaced in its middle is said, and the full
    restore puts it back."""
    words = [f"w{i}" for i in range(1000)]
    lossi: list[float] = []
    ns = {"words": words, "lossi": lossi}
    snapshot = _take(ns)
    lossi.append(1.0)  # the probe's run
    snapshot.note_unwritten()
    (written,) = snapshot.python.written
    assert written.label == "lossi"

    lossi.append(2.0)
    words.append("new")  # a write the mark sees
    snapshot.restore(written_only=True)
    assert lossi == [] and len(words) == 1000

    words[500] = "changed"  # one it does not see
    snapshot.restore(written_only=True)
    assert words[500] == "changed"
    assert snapshot.written_unseen_objects() == ["words"]
    snapshot.restore()
    assert words[500] == "w500" and snapshot.written_unseen_objects() == []


@pytest.mark.parametrize("reads_first", [True, False])
def test_objects_the_walk_must_not_enter_are_left_alone(reads_first: bool):
    """torch's own objects (an optimizer's state is the guard's own business), modules and
    the namespace itself are not snapshotted as Python objects."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ns = {"opt": opt, "model": model, "mod": random, "myself": None}
    ns["myself"] = ns
    snap = pystate.take(ns, ["opt", "mod", "myself"] if reads_first else None)
    labels = {part.label for part in snap.parts}
    assert labels == set(), labels
    assert snap.modules == [model]


def test_memory_files_get_their_contents_and_position_back():
    import io

    raw, text = io.BytesIO(b"abc"), io.StringIO("line\n")
    raw.seek(1)
    snapshot = _take({"raw": raw, "text": text})
    raw.write(b"XYZ")
    text.read()
    text.write("more\n")
    snapshot.restore()
    assert (raw.getvalue(), raw.tell()) == (b"abc", 1)
    assert (text.getvalue(), text.tell()) == ("line\n", 0)
    assert snapshot.unrestorable_changes() == []  # in memory: nothing to name


class Unreadable(collections.deque):
    def __len__(self) -> int:
        raise RuntimeError("no length here")


def test_what_cannot_be_read_or_written_back_is_named_and_the_rest_restored():
    broken, values, kept = Unreadable([1]), np.zeros(3), [1]
    snapshot = _take({"broken": broken, "values": values, "kept": kept})
    assert snapshot.not_covered == [
        "`broken` (a Unreadable) was not snapshotted: reading it raised RuntimeError: no "
        "length here"
    ]
    values += 1
    values.flags.writeable = False  # the run left it read-only
    kept.append(2)
    snapshot.restore()
    assert kept == [1]
    assert snapshot.not_covered[1].startswith("`values` could not be put back (ValueError")


def test_a_cell_that_advances_a_generator_runs_once_and_says_why(ip):
    """A generator from an earlier cell cannot be rewound: the cell runs once (the probe,
    never cut short), nothing is timed, and the report says why."""
    ip.run_cell(
        "import torch\n"
        "batches = (torch.randn(8, 4) for _ in range(100))\n"
        "w = torch.randn(4, 1, requires_grad=True)\n"
        "seen = []"
    )
    result = ip.run_cell(
        "%%perfcheck -o -q --budget 2\n"
        "for _ in range(3):\n"
        "    x = next(batches)\n"
        "    loss = (x @ w).sum()\n"
        "    loss.backward()\n"
        "    seen.append(loss.item())\n"
    )
    report = result.result
    assert len(ip.user_ns["seen"]) == 3  # the cell ran once
    assert sum(1 for _ in ip.user_ns["batches"]) == 97  # one run's worth consumed
    said = [w for w in report.warnings if "no restore can put back" in w]
    assert said and "batches" in said[0]
    assert report.cell_run is not None and report.cell_run.status == "probe"
    assert all(v.speedup is None for v in report.variants)
