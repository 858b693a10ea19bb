"""The measuring engine, in the order of the flow: the cell as a runnable `workload`, the
instrumented `probe` (with `discovery` of live objects), `steps` and their sampling, the
state guard (`state`), reversible `fixes`, honest `timing`, `numerics`, `memory` and
`utilisation`, and `codeedit` for the permanent code changes.

Nothing here imports IPython, ipywidgets or the renderers.
"""
