"""Whole programs: scripts and unmarked notebooks checked end to end (`check`, `scan`)."""
