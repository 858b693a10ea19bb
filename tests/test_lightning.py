"""PyTorch Lightning's `Trainer.fit` under perfcheck, for real (CPU, a small random model):
the loop is sampled by batches, the main-process loader is found and its fix measured
through the user's loader (the Trainer is built in the checked cell), and the model ends as
after one plain `fit`."""

from __future__ import annotations

import contextlib
import io
import logging
import textwrap
from collections.abc import Iterator

import pytest
import torch
from workloads import namespace_with

from torchtune_magic import perfcheck, session

pytest.importorskip("pytorch_lightning")

SETUP = """
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader
from slow_data import SlowDataset


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


torch.manual_seed(0)
model = Regressor()
loader = DataLoader(SlowDataset(64, delay_s=0.004), batch_size=8)
"""

FIT = textwrap.dedent(
    """
    trainer = pl.Trainer(
        max_epochs=8, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, loader)
    """
)


@pytest.fixture(autouse=True)
def short_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe stops after half a second (users get 3-8 s), so this 2 s fit is "long"."""
    monkeypatch.setattr(session, "PROBE_SECONDS", (0.5, 0.5))


@contextlib.contextmanager
def lightning_log(capsys: pytest.CaptureFixture[str]) -> Iterator[io.StringIO]:
    """What a notebook shows of Lightning's log. Lightning adds a StreamHandler holding the
    process's stderr when it is imported (in a kernel, ipykernel's stream); here stderr is a
    buffer the test reads, with pytest's own capture, which swaps stderr, suspended."""
    shown = io.StringIO()
    logger = logging.getLogger("pytorch_lightning")
    with capsys.disabled(), contextlib.redirect_stderr(shown):
        handlers, logger.handlers = logger.handlers, [logging.StreamHandler()]
        try:
            yield shown
        finally:
            logger.handlers = handlers


def test_fit_is_sampled_its_loader_fix_measured_and_the_model_ends_as_one_plain_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with lightning_log(capsys) as shown:
        plain = namespace_with(SETUP)
        exec(FIT, plain)
        expected = {k: v.clone() for k, v in plain["model"].state_dict().items()}

        ns = namespace_with(SETUP)
        model, loader = ns["model"], ns["loader"]
        # 6 s left the workers' fix without a round once on a busy machine; the rounds stop
        # once its verdict is in, so a quiet machine waits no longer
        report = perfcheck(FIT, ns, budget=10)

    workers = report.finding("dataloader-workers")
    assert workers is not None and workers.fixable and workers.where.startswith("loader")
    variant = report.variant_for(["dataloader-workers"])
    assert variant.error is None, variant.error  # once KeyError: 'trainer'
    assert variant.speedup is not None, (variant.budget_to_tell_s, report.warnings)
    assert variant.speedup > 1.5  # 4 ms items: workers overlap the waits
    assert variant.numerics.verdict == "identical"

    sampled = report.sampling
    assert sampled is not None and sampled.unit == "batch" and not sampled.probe_complete
    assert sampled.steps_per_run == 8 * 8
    assert "Lightning Trainer: max_epochs=8 x 8 training batches" in sampled.steps_detail
    assert report.cell_run.status == "complete" and report.cell_run.steps == 8 * 8

    assert ns["model"] is model and ns["loader"] is loader
    actual = ns["model"].state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key
    assert ns["trainer"].current_epoch == 8  # the cell's own Trainer, after its whole fit
    # Lightning logs on every Trainer it builds: the probe's and the measuring runs' lines
    # stay hidden; the plain fit and the complete run each log once
    assert shown.getvalue().count("GPU available: False") == 2
