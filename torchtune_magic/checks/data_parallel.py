"""`nn.DataParallel` over several GPUs (`data-parallel`), which the guide's distributed part
replaces with DistributedDataParallel.

DataParallel runs in one process: every forward copies the model from the first GPU to the
others, splits the batch, runs the replicas from threads that share one GIL, and gathers
the outputs and gradients back on the first GPU, which then holds more memory than the rest.
DDP runs one process per GPU, keeps a replica on each, and overlaps the gradient all-reduce
with the backward. The change is the launch itself (torchrun starting a process per GPU), so
there is no live fix: the finding gives the torchrun command and the code that goes with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..report import FORWARD, CodeChange, count
from .base import Check, Detection

if TYPE_CHECKING:
    from ..probe.observation import Observation


class DataParallelCheck(Check):
    id = "data-parallel"
    title = "nn.DataParallel drives several GPUs from one process"
    guide = "Distributed optimizations"
    devices = ("cuda",)
    threshold = "nn.DataParallel over two or more GPUs"

    def not_applicable(self, obs: Observation) -> str | None:
        reason = super().not_applicable(obs)
        gpus = torch.cuda.device_count()
        if reason is None and gpus < 2:
            reason = (
                "not applicable: DataParallel spreads work over two or more GPUs; "
                f"{gpus} {'is' if gpus == 1 else 'are'} visible here"
            )
        return reason

    def detect(self, obs: Observation) -> list[Detection]:
        found = []
        for use in obs.modules.values():
            model = use.module
            if not isinstance(model, nn.DataParallel) or len(model.device_ids) < 2:
                continue
            gpus = len(model.device_ids)
            name = obs.module_path(model)
            line = min(use.lines) if use.lines else None
            found.append(
                Detection(
                    self.finding(
                        evidence=(
                            f"`{name}` is an nn.DataParallel over {gpus} GPUs, called "
                            f"{count(use.calls, 'time')}"
                        ),
                        details=(
                            f"each forward copies the model from GPU {model.device_ids[0]} to "
                            "the others, splits the batch and gathers the outputs back there, "
                            "all from one Python process whose threads share one GIL"
                        ),
                        segment=FORWARD,
                        where=f"`{name}`" + (f", cell line {line}" if line else ""),
                        fixable=False,
                        line=line,
                        caveat=(
                            "DDP needs the training loop in a script torchrun starts once per "
                            "GPU: a notebook cell can launch it, not run it"
                        ),
                        code_change=CodeChange(elsewhere=[_ddp_form(gpus)]),
                    )
                )
            )
        return found


def _ddp_form(gpus: int) -> str:
    return (
        f"one process per GPU: run the training as a script with `torchrun --nproc-per-node "
        f"{gpus} train.py`, and in it `dist.init_process_group('nccl')`, "
        "`local_rank = int(os.environ['LOCAL_RANK'])`, `torch.cuda.set_device(local_rank)`, "
        "`model = DistributedDataParallel(model.to(local_rank), device_ids=[local_rank])` "
        "instead of `nn.DataParallel(model)`, and a `DistributedSampler` on the DataLoader; "
        "run `%%perfcheck`'s API there (`perfcheck(cell, globals())`) to measure it"
    )
