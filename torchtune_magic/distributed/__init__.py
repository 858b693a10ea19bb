"""Distributed runs: under torchrun every rank takes the same measuring decisions
(`lockstep`). Below every other room: the probe, the checks and measuring use it."""
