"""perfcheck adds no warning of its own to the user's output: a rebuilt DDP wrapper (both
settings fixes), a rebuilt DataLoader (more workers, a DistributedSampler) and a compiled
function print nothing a plain run of the same cell does not.

torch warns from inside torch, with a `stacklevel` that points at whoever called it, so a
filter on our module would miss what the user sees: each test records every warning raised
while our fix is applied and the cell runs with it, and holds it against a plain run of the
same cell (whatever the user's own code warns about is theirs, not ours).
"""

from __future__ import annotations

import socket
import textwrap
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from workloads import detected, namespace_with

from torchtune_magic import perfcheck
from torchtune_magic.checks.ddp_settings import BucketViewFix, FindUnusedFix, plan_for
from torchtune_magic.checks.distributed import DistributedSamplerFix
from torchtune_magic.checks.loader.rebuild import plan_for as loader_plan_for
from torchtune_magic.kernel.discovery import walk
from torchtune_magic.kernel.fixes import Fix

pytestmark = pytest.mark.skipif(
    not dist.is_available(), reason="torch built without torch.distributed"
)

TRAIN = """
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _emitted(action: Callable[[], object]) -> list[str]:
    """Every warning `action` raises that a notebook shows, each time it is raised, as
    `Category: message`. A notebook runs under Python's default filters, which show a
    DeprecationWarning only where `__main__` (the user's code) raises it: torch's own, raised
    at import inside torch, never reach the user (ours would, and count)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for hidden in (
            DeprecationWarning,
            PendingDeprecationWarning,
            ImportWarning,
            ResourceWarning,
        ):
            warnings.filterwarnings("ignore", category=hidden)
        for shown in ("__main__", "torchtune_magic"):
            warnings.filterwarnings("always", category=DeprecationWarning, module=shown)
        action()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def _ours(plain: list[str], checked: list[str]) -> list[str]:
    """The warnings of the checked run that the plain run did not raise."""
    return [w for w in checked if w not in plain]


def _run(cell: str, ns: dict[str, Any]) -> Callable[[], None]:
    return lambda: exec(textwrap.dedent(cell), ns)


def _with_fixes(fixes: list[Fix], cell: str, ns: dict[str, Any]) -> Callable[[], None]:
    """Apply `fixes`, run the cell under them as a measuring run does, undo them."""

    def run() -> None:
        for fix in fixes:
            fix.apply(ns)
        try:
            with ExitStack() as stack:
                for fix in fixes:
                    stack.enter_context(fix.run_context(ns))
                _run(cell, ns)()
        finally:
            for fix in reversed(fixes):
                fix.undo()

    return run


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo process group of one rank in this process, gone after the test."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp_namespace(**ddp: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)
    )
    with warnings.catch_warnings():  # the user's own DDP call: whatever it says is theirs
        warnings.simplefilter("ignore")
        model = DistributedDataParallel(module, **ddp)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    return {
        "torch": torch,
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.01),
        "loader": DataLoader(data, batch_size=8, shuffle=True),
    }


@pytest.mark.parametrize(
    "ddp",
    [
        {"find_unused_parameters": True},
        {"find_unused_parameters": True, "broadcast_buffers": False},
    ],
    ids=["defaults", "no-buffer-sync"],
)
def test_rebuilt_ddp_wrappers_warn_nothing_and_keep_the_users_settings(
    one_rank_group: None, ddp: dict[str, Any]
) -> None:
    ns = _ddp_namespace(**ddp)
    model = ns["model"]
    plain = _emitted(_run(TRAIN, ns))
    plan = plan_for(model, walk(ns)[id(model)].locations)
    fixes: list[Fix] = [
        FindUnusedFix({"find_unused_parameters": False}, plan),
        BucketViewFix({"gradient_as_bucket_view": True}, plan),
    ]
    rebuilt: list[DistributedDataParallel] = []
    checked = _emitted(
        _with_fixes(fixes, TRAIN + "\nrebuilt.append(model)\n", {**ns, "rebuilt": rebuilt})
    )
    assert _ours(plain, checked) == []
    (wrapper,) = rebuilt
    assert wrapper is not model and wrapper.module is model.module
    assert not wrapper.find_unused_parameters and wrapper.gradient_as_bucket_view
    assert wrapper.forward_sync_buffers == model.forward_sync_buffers  # the user's, kept


def test_a_loader_rebuilt_with_a_distributed_sampler_warns_nothing(one_rank_group: None) -> None:
    ns = _ddp_namespace()
    loader = ns["loader"]
    plain = _emitted(_run(TRAIN, ns))
    plan = loader_plan_for(loader, walk(ns)[id(loader)].locations)
    sampler = DistributedSampler(loader.dataset, num_replicas=1, rank=0, shuffle=True)
    checked = _emitted(_with_fixes([DistributedSamplerFix(plan, sampler)], TRAIN, ns))
    assert _ours(plain, checked) == []
    assert ns["loader"] is loader


def test_the_dataloader_workers_fix_warns_nothing() -> None:
    """perfcheck end to end on a loader that waits on I/O: its trial, the measured runs with
    more workers than this machine's cores, the undo."""
    setup = """
import torch
from tests.slow_data import SlowDataset
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = torch.utils.data.DataLoader(SlowDataset(64, delay_s=0.01), batch_size=8)
"""
    plain = _emitted(_run(TRAIN, namespace_with(setup)))
    ns = namespace_with(setup)
    reports = []
    checked = _emitted(
        lambda: reports.append(perfcheck(TRAIN, ns, checks="dataloader-workers", budget=4))
    )
    assert reports[0].finding("dataloader-workers") is not None  # the fix was measured
    assert _ours(plain, checked) == []


GELU = """
import torch
def new_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))
x = torch.randn(64, 512)
"""
GELU_CELL = "for _ in range(20):\n    y = new_gelu(x)\n"


def test_the_compiled_function_warns_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    ns = namespace_with(GELU)
    plain = _emitted(_run(GELU_CELL, ns))
    session = detected(GELU_CELL, ns)

    def compiled_run() -> None:
        session.apply("fuse-pointwise")
        try:
            _run(GELU_CELL, ns)()
        finally:
            session.undo("fuse-pointwise")

    checked = _emitted(compiled_run)
    assert _ours(plain, checked) == []
    assert not hasattr(ns["new_gelu"], "_torchdynamo_orig_callable")
