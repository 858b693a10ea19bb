"""Measuring: the plan (`plan`), the runs that carry it out (`runs`, one run in `run`, the
out-of-memory fits in `fits`) and the figures drawn from them (`figures`); timing in paired
rounds (`timing`) and their `verdict`, whether a fix changed results (`numerics`, `losses`),
where a run's time went (`time_split`) and the FLOPs it reached (`utilisation`). Needs
neither IPython nor any renderer."""
