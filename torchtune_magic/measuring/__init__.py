"""Measuring: the plan (`plan`), the runs that carry it out (`runs`) and the figures drawn
from them (`figures`). Needs neither IPython nor any renderer."""
