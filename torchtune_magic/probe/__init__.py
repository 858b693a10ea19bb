"""The probe: one instrumented run of the cell (`probe`), the hooks that record it
(`recorder`) and what it saw (`observation`); the cell's steps (`steps`), and what else the
probe reads off the cell, the machine and the training frameworks (`graphs`, `memory`,
`load`, `cpu`, `frameworks`, `launchers`, `oom`, `plain_sample`).
"""
