"""DataLoader checks: batches loaded in the main process, pageable host memory.

Guide sections: "Enable asynchronous data loading and augmentation" (num_workers > 0) and
"Use pinned memory buffers" (pin_memory=True with non_blocking copies). Both fixes rebuild
the user's loader with the same dataset, sampler and settings and rebind it wherever the
namespace holds it. They go through one `LoaderPlan` per loader, which rebinds the loader
built from the union of the applied fixes' settings, so the two compose and undo in any
order and undo always puts back the very object the user built.

Modules, one job each: `rebuild` (the plan and the rebuilt loaders), `pickling` (whether
workers can load the data at all), `trial` (timing the loader and picking the worker
count), `target` (where a flagged loader lives and how a fix reaches it), `edits` (cell
text edits), `fixes` (the Fix classes) and `checks` (the two checks).
"""

from .checks import WAIT_SHARE, PinMemoryCheck, WorkersCheck, lines_text
from .edits import non_blocking_edit

__all__ = ["WAIT_SHARE", "PinMemoryCheck", "WorkersCheck", "lines_text", "non_blocking_edit"]
