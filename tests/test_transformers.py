"""Hugging Face `Trainer.train()` under perfcheck, for real (CPU, tiny random-init BERT built
from a config, token ids made with torch, nothing from the hub).

The Trainer is built in an earlier cell and `trainer.train()` is the checked cell, as in the
Hugging Face docs: the DataLoader is built inside `train()` from `trainer.args`, so findings
and fixes go through `TrainingArguments`; the run is sampled by batches, counted from the
Trainer's own settings, and the model ends as after one plain `train()`. The manual loop of
the Hugging Face course and a Trainer with good settings raise nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from workloads import detected, namespace_with

from torchtune_magic import perfcheck, session
from torchtune_magic.checks.loader.fixes import TrainerPinMemoryFix, TrainerWorkersFix
from torchtune_magic.kernel import fixes
from torchtune_magic.kernel.trainers import HFTrainer
from torchtune_magic.probe import frameworks, steps

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never the hub, whatever a test builds
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

MODEL = """
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from hf_data import TokenDataset

torch.manual_seed(0)
config = BertConfig(
    hidden_size=64, num_hidden_layers={layers}, num_attention_heads=2, intermediate_size=128,
    vocab_size=1000,
)
model = BertForSequenceClassification(config)
"""
ARGS = """
args = TrainingArguments(
    output_dir=OUT, per_device_train_batch_size=8, num_train_epochs=2, seed=0,
    dataloader_num_workers={workers}, use_cpu=True, report_to=[], save_strategy="no",
    disable_tqdm=True, logging_strategy="no",{extra}
)
trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(128, delay_s={delay}))
"""
TRAIN = "trainer.train()\n"
STEPS = 2 * 16  # num_train_epochs x batches of 8 from 128 items
# checks of the kernel process rather than of the training (threads against this machine's
# cores, glibc's page faults): tested in test_checks_cpu.py, left out of the clean controls
PROCESS_CHECKS = "cpu-threads,cpu-allocator"
DELAY_S = 0.005  # per item: 40 ms of waiting per batch, about twice the tiny model's step
# per item where the workers' gain is asserted: 80 ms of waiting per batch. With 40 ms the
# gain read 1.29x beside a CPU-bound process (the model's step stretches there, the waits do
# not, and workers overlap only the waits); with 80 ms it read 4-6x there. Not
# longer: at 160 ms a busy machine's budget went to cpu-threads before the workers' round
SLOW_ITEM_S = 0.01


def trainer_cell(workers: int = 0, delay: float = DELAY_S, layers: int = 2, extra: str = "") -> str:
    """The earlier cell that builds the model, its TrainingArguments and the Trainer."""
    text = MODEL.format(layers=layers) + ARGS.format(workers=workers, delay=delay, extra=extra)
    return textwrap.dedent(text).lstrip()


def notebook(cell: str, out: Path) -> dict[str, Any]:
    """A kernel's namespace after running `cell` as In[1] (so code changes reach it)."""
    return namespace_with(cell, OUT=str(out), In=["", cell])


@pytest.fixture(autouse=True)
def short_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe stops after a second (users get 3-8 s), so a 2 s train() is "long"."""
    monkeypatch.setattr(session, "PROBE_SECONDS", (1.0, 1.0))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def test_train_is_flagged_measured_through_its_arguments_and_ends_as_one_plain_train(
    tmp_path: Path,
) -> None:
    cell = trainer_cell(delay=SLOW_ITEM_S)
    plain = notebook(cell, tmp_path)
    exec(TRAIN, plain)
    expected = _state(plain["model"])

    ns = notebook(cell, tmp_path)
    model, args, trainer = ns["model"], ns["args"], ns["trainer"]
    # worker processes of other tests' loaders (kept alive by a failed test's traceback)
    # are not this test's business
    before = set(multiprocessing.active_children())
    # 8 warm-up steps (4 workers prefetching 2 each) and the timed ones: with one CPU-bound
    # process beside it, a run of each takes seconds
    report = perfcheck(TRAIN, ns, budget=20)

    workers = report.finding("dataloader-workers")
    assert workers is not None and workers.fixable
    assert "TrainingArguments(dataloader_num_workers=0)" in workers.details
    assert workers.where.startswith("the DataLoader trainer builds from trainer.args")
    (change,) = workers.code_change.cells  # the earlier cell's TrainingArguments(...) call
    assert change.execution_count == 1
    assert "+    dataloader_num_workers=" in change.diff
    assert "dataloader_persistent_workers=True," in change.diff  # the call's trailing comma kept
    variant = report.variant_for(["dataloader-workers"])
    assert variant.error is None, variant.error
    assert variant.speedup > 1.5  # 10 ms items: workers overlap the waits
    # the sampled runs hold an epoch restart (the first epoch is ended early): from the
    # second epoch on, persistent workers shift the global random stream by one draw, so
    # the shuffle differs from a run without workers (a plain train() of 2 epochs with
    # dataloader_persistent_workers=True differs too); the caveat says so
    assert variant.numerics.verdict == "changed"
    assert "from the second epoch on" in workers.caveat
    assert report.sampling is not None and report.sampling.steps_per_epoch == STEPS // 2

    sampled = report.sampling
    assert sampled is not None and sampled.unit == "batch" and not sampled.probe_complete
    assert sampled.steps_per_run == STEPS
    assert "Hugging Face Trainer: num_train_epochs=2 x 16 batches" in sampled.steps_detail
    assert report.cell_run.status == "complete" and report.cell_run.steps == STEPS

    # the kernel is as after one plain train(): the user's objects, the model's values,
    # the Trainer's own arguments back, no worker process left behind
    assert ns["model"] is model and ns["args"] is args and ns["trainer"] is trainer
    assert trainer.args is args and args.dataloader_num_workers == 0
    actual = ns["model"].state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key
    assert trainer.state.global_step == plain["trainer"].state.global_step == STEPS // 1
    assert set(multiprocessing.active_children()) - before == set()


def test_the_workers_fix_swaps_the_trainers_arguments_and_undoes_exactly(
    tmp_path: Path,
) -> None:
    ns = notebook(trainer_cell(), tmp_path)
    trainer, args = ns["trainer"], ns["args"]
    checked = detected(TRAIN, ns, checks="dataloader-workers")
    fix = checked.fix_for("dataloader-workers")
    assert isinstance(fix, TrainerWorkersFix)

    checked.apply("dataloader-workers")
    swapped = trainer.args
    assert swapped is not args and type(swapped) is type(args)
    assert swapped.dataloader_num_workers >= 1 and swapped.dataloader_persistent_workers
    assert args.dataloader_num_workers == 0  # the user's own arguments are not touched
    assert swapped.output_dir == args.output_dir and swapped.seed == args.seed
    checked.undo("dataloader-workers")
    assert trainer.args is args

    # the user assigns arguments of their own: applying refuses, nothing changes
    mine = trainer.args = frameworks.ArgsPlan(HFTrainer("trainer", trainer)).args_for(
        {"dataloader_num_workers": 1}
    )
    with pytest.raises(fixes.FixError, match="rebound since the probe"):
        checked.apply("dataloader-workers")
    assert trainer.args is mine
    trainer.args = args

    # ... or while the fix is applied: undo leaves theirs, and says so
    checked.apply("dataloader-workers")
    trainer.args = mine
    notes = checked.undo("dataloader-workers")
    assert trainer.args is mine and any("trainer.args" in note for note in notes)
    trainer.args = args

    # a new Trainer under the same name: the fix refuses to touch it
    ns["trainer"] = object.__new__(type(trainer))
    vars(ns["trainer"]).update(vars(trainer))
    with pytest.raises(fixes.FixError, match="`trainer` was rebound"):
        checked.apply("dataloader-workers")
    assert ns["trainer"].args is args


def test_fixes_on_one_trainers_arguments_compose_in_any_order(tmp_path: Path) -> None:
    """Workers and pinned memory (a CUDA check, its fix built here by hand) both swap
    `trainer.args`: each keeps the other's settings, and undo in either order ends on the
    user's own object."""
    ns = notebook(trainer_cell(), tmp_path)
    trainer, args = ns["trainer"], ns["args"]
    plan = frameworks.args_plan(HFTrainer("trainer", trainer))
    workers = TrainerWorkersFix(
        {"dataloader_num_workers": 2, "dataloader_persistent_workers": True}, plan
    )
    pinned = TrainerPinMemoryFix({"dataloader_pin_memory": True}, plan)
    for first, second in ((workers, pinned), (pinned, workers)):
        workers.apply(ns)
        pinned.apply(ns)
        both = trainer.args
        assert both.dataloader_num_workers == 2 and both.dataloader_pin_memory
        first.undo()
        assert trainer.args is plan.args_for(second.overrides)
        second.undo()
        assert trainer.args is args


INLINE_ARGS = f"""
trainer = Trainer(
    model=model,
    args=TrainingArguments(
        output_dir=OUT, per_device_train_batch_size=8, num_train_epochs=2, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_strategy="no",
    ),
    train_dataset=TokenDataset(128, delay_s={DELAY_S}),
)
"""


def test_arguments_written_inside_the_trainer_call_get_the_edit(tmp_path: Path) -> None:
    cell = textwrap.dedent(MODEL.format(layers=2) + INLINE_ARGS).lstrip()
    ns = notebook(cell, tmp_path)
    checked = detected(TRAIN, ns, checks="dataloader-workers")
    (finding,) = [d.finding for d in checked.detections]
    (change,) = finding.code_change.cells
    assert change.execution_count == 1
    edited = [line for line in change.diff.splitlines() if line.startswith("+ ")]
    assert len(edited) == 1 and "disable_tqdm=True" in edited[0]
    assert "dataloader_num_workers=" in edited[0]
    assert "dataloader_persistent_workers=True" in edited[0]


def test_a_trainer_with_good_settings_raises_nothing(tmp_path: Path) -> None:
    """Workers where loading costs something; in-memory tokenized data in the main
    process, where workers could only add inter-process hand-over. The checks of the
    process rather than the training (`cpu-threads`: workers + intra-op threads against
    this machine's cores; `cpu-allocator`: glibc's page faults) judge the kernel, not the
    Trainer (PROCESS_CHECKS); on a 2-core machine they rightly fire."""
    for workers, delay in ((2, DELAY_S), (0, 0.0)):
        ns = notebook(trainer_cell(workers=workers, delay=delay), tmp_path)
        checked = detected(TRAIN, ns, skip=PROCESS_CHECKS)
        assert [d.finding.id for d in checked.detections] == [], (workers, delay)


COURSE_SETUP = """
import torch
from torch.utils.data import DataLoader
from transformers import (
    BertConfig, BertForSequenceClassification, default_data_collator, get_scheduler,
)
from hf_data import TokenDataset

torch.manual_seed(0)
config = BertConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
    vocab_size=1000,
)
model = BertForSequenceClassification(config)
train_dataloader = DataLoader(
    TokenDataset(128), shuffle=True, batch_size=8, collate_fn=default_data_collator
)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
num_epochs = 3
num_training_steps = num_epochs * len(train_dataloader)
lr_scheduler = get_scheduler(
    "linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=num_training_steps
)
device = torch.device("cpu")
model.to(device)
"""

COURSE_LOOP = """
model.train()
for epoch in range(num_epochs):
    for batch in train_dataloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs = model(**batch)
        loss = outputs.loss
        loss.backward()

        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
"""


def test_the_course_training_loop_raises_no_false_alarm() -> None:
    """The manual loop of the Hugging Face course: in-memory tokenized batches, AdamW,
    `get_scheduler`, `optimizer.zero_grad()` after `lr_scheduler.step()` (torch >= 2 sets
    the grads to None)."""
    ns = namespace_with(COURSE_SETUP)
    checked = detected(COURSE_LOOP, ns, skip=PROCESS_CHECKS)
    assert [d.finding.id for d in checked.detections] == []
    assert checked.step_count is not None
    assert checked.step_count.total == 3 * 16


@pytest.mark.parametrize(
    ("epochs", "max_steps", "accumulate"),
    [(2, -1, 1), (1.5, -1, 3), (3, 5, 2)],
    ids=["epochs", "fractional-epochs-accumulated", "max-steps"],
)
def test_batches_per_train_come_from_the_trainers_arguments(
    tmp_path: Path, epochs: float, max_steps: int, accumulate: int
) -> None:
    """What `hf_total_batches` works out is what a plain `train()` draws, counted the way
    measuring runs count (accelerate's loader draws one batch ahead)."""
    extra = f"\n    max_steps={max_steps}, gradient_accumulation_steps={accumulate},"
    cell = trainer_cell(delay=0.0, extra=extra)
    cell = cell.replace("num_train_epochs=2", f"num_train_epochs={epochs}")
    ns = notebook(cell, tmp_path)
    trainer = ns["trainer"]
    probe_loader = trainer.get_train_dataloader()
    predicted, detail = frameworks.hf_total_batches(trainer, probe_loader)
    assert "Hugging Face Trainer" in detail
    counter = steps.StepCounter(steps.StepSource("batch", "trainer", trainer.train_dataset))
    with counter.counting() as times:
        exec(TRAIN, ns)
    assert times.count == predicted, detail
