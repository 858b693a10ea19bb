"""Frameworks that accumulate gradients the right way, under real torchrun (gloo, CPU), for
tests/test_torchrun.py: a Lightning `Trainer(strategy="ddp", devices=2,
accumulate_grad_batches=4)` fit in the checked cell (Lightning joins the process group
inside `fit`), and a Hugging Face `Trainer` with `gradient_accumulation_steps=4` built in an
earlier cell (`TrainingArguments` joins it) with `trainer.train()` checked.

    torchrun --nproc-per-node 2 tests/ddp_frameworks_script.py lightning|hf plain|perfcheck OUT

Rank 0 writes OUT/report-FRAMEWORK.json; each rank saves its model's state to
OUT/state-FRAMEWORK-MODE-RANK.pt.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

framework, mode, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
torch.set_num_threads(1)
torch.manual_seed(0)

if framework == "lightning":
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
            )

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    model = Regressor()
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(
        TensorDataset(torch.randn(128, 8, generator=generator), torch.randn(128, 1)),
        batch_size=8,
    )
    CELL = """
trainer = pl.Trainer(
    max_epochs=2, accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=4,
    logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, loader)
"""
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_data import TokenDataset
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    config = BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=1000,
    )
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=8,
        num_train_epochs=1,
        gradient_accumulation_steps=4,
        seed=0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        logging_strategy="no",
        ddp_backend="gloo",
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(128))
    CELL = "trainer.train()\n"

rank = int(os.environ["RANK"])
if mode == "plain":
    exec(CELL)
else:
    from torchtune_magic import perfcheck

    perfcheck(
        CELL,
        globals(),
        budget=10,
        skip="cpu-threads",
        json=out / f"report-{framework}.json",
    )
state = {k: v.detach().clone() for k, v in model.state_dict().items()}
torch.save(state, out / f"state-{framework}-{mode}-{rank}.pt")
