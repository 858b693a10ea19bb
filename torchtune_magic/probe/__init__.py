"""The probe: one instrumented run of the cell (`probe`), its steps (`steps`) and
what else it reads off the cell, the machine and the training frameworks.
"""
