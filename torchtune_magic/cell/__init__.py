"""The cell and the notebook: the cell as a runnable `workload`, its own `loops`, where it
sits in the notebook (`notebook`), the earlier cells that built its objects (`history`) and
line-level edits of their source (`codeedit`)."""
