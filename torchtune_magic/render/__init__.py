"""Renderers: each is `render(report) -> output`; none of them measures anything."""
