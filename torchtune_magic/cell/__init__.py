"""The cell and the notebook: the cell as a runnable `workload`, its own `loops`,
the kernel's earlier cells (`history`) and line-level edits of their source
(`codeedit`)."""
