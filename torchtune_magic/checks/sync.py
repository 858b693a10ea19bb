"""Host reads of device values inside the loop (`.item()`, `print(t)`, `.cpu()`, `nonzero`).

Guide (GPU part): "Avoid unnecessary CPU-GPU synchronization". Each read makes the host
wait until the GPU has drained its queue, so the host can no longer run ahead and queue the
next step's kernels while the current ones run.

Advice only: the fix (accumulate on the device, read once; log every N steps) changes what
the cell prints, which only the user can judge. Not applicable on CPU, by choice: there a
`.item()` reads memory the host already has — nothing to wait for — and nearly every CPU
training loop logs its loss, so flagging it would be noise with no cost behind it. The
detection itself is device-independent (it counts reads of tensors on the run's device),
so it is tested on CPU observations.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from ..report import HOST_SYNC, CodeChange, count
from .base import Check, Detection

if TYPE_CHECKING:
    from ..probe.observation import Observation

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item")
LABELS = {
    "item": ".item()",
    "tolist": ".tolist()",
    "cpu": ".cpu()",
    "to(cpu)": ".to(cpu)",
    "numpy": ".numpy()",
    "nonzero": ".nonzero()",
    "__bool__": "bool(tensor) / if tensor",
    "__float__": "float(tensor)",
    "__int__": "int(tensor)",
    "__format__": "f-string of a tensor",
    "__repr__": "print(tensor)",
}


def steps_of(obs: Observation) -> int:
    """Loop iterations: optimizer steps, else backward passes, else model calls."""
    if obs.optimizer_steps:
        return max(count for _, count in obs.optimizer_steps.values())
    if obs.backward_calls:
        return obs.backward_calls
    outer = [use.outer_calls for use in obs.modules.values() if use.outer_calls]
    return max(outer, default=1)


class HostSyncCheck(Check):
    id = "host-sync"
    title = "The loop reads GPU values on the host every step"
    guide = "Avoid unnecessary CPU-GPU synchronization"
    devices = ("cuda",)

    def not_applicable(self, obs: Observation) -> str | None:
        if obs.device != "cuda":
            return (
                "not applicable on CPU: a CPU .item()/print(tensor) reads memory the host "
                "already has; the wait only exists with an asynchronous device"
            )
        return None

    def detect(self, obs: Observation) -> list[Detection]:
        reads = [s for s in obs.host_syncs if s.detail == obs.device and s.line is not None]
        per_line = Counter((s.line, s.kind) for s in reads)
        repeated = {key: n for key, n in per_line.items() if n > 1}  # in a loop, not once
        if not repeated:
            return []
        total = sum(repeated.values())
        steps = steps_of(obs)
        parts = [
            f"{LABELS.get(kind, kind)} ×{n} at line {line}"
            for (line, kind), n in sorted(repeated.items())
        ]
        profiled = [
            f"{name} ×{obs.op_totals[name][0]}" for name in SYNC_OPS if name in obs.op_totals
        ]
        evidence = (
            f"{total} host reads of {obs.device} tensors in one run, {total / steps:.1f} per "
            f"step over {count(steps, 'step')}"
        )
        details = "; ".join(parts)
        if profiled:
            details += f" (profiler: {', '.join(profiled)})"
        details += "; each one waits for every queued kernel to finish"
        lines = sorted({line for line, _ in repeated})
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details=details,
                    segment=HOST_SYNC,  # the reads the split times as host syncs
                    where="cell line"
                    + ("s " if len(lines) > 1 else " ")
                    + ", ".join(map(str, lines)),
                    fixable=False,
                    line=lines[0],
                    caveat="the cost is on the GPU: a CPU run reads its own memory",
                    code_change=CodeChange(
                        "",
                        [
                            "accumulate on the device (total += loss.detach()) and read it "
                            "once after the loop, or log every N steps",
                            "keep masks as tensors (torch.where, masked ops) instead of "
                            "nonzero()/boolean indexing, whose output size the host must read",
                        ],
                    ),
                ),
            )
        ]
