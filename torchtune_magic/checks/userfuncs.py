"""Find a user function where it lives in the namespace, so a fix can rebind it there.

The probe sees code objects (on the stack, in profiler spans); a fix needs the function
objects and every place they are bound: a name, a class attribute, a closure cell of a
factory, an attribute of a user object. Undo puts the original object back at each place.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from ..kernel import discovery


def function_locations(
    namespace: dict[str, Any], code: types.CodeType, *, module_methods: bool = False
) -> tuple[types.FunctionType | None, list[discovery.Location], bool]:
    """Functions with this code reachable from the namespace: by name, as class attributes,
    in closure cells (factories) and on user objects. The bool says one is a method of an
    nn.Module subclass: such a location is returned only with `module_methods` (compiling
    takes the module rather than its method; wrapping a method in no_grad is fine)."""
    Step, Location = discovery.Step, discovery.Location
    hits: list[tuple[types.FunctionType, Location]] = []
    on_module = False
    seen: set[int] = set()
    frontier: list[tuple[tuple[discovery.Step, ...], Any]] = [
        ((Step("name", k),), v) for k, v in namespace.items() if not k.startswith("_")
    ]
    for _depth in range(3):
        following = []
        for path, value in frontier:
            if id(value) in seen or isinstance(value, (types.ModuleType, torch.Tensor)):
                continue
            seen.add(id(value))
            if isinstance(value, types.FunctionType):
                if value.__code__ is code:
                    hits.append((value, Location(path)))
                for index, cell in enumerate(value.__closure__ or ()):
                    try:
                        following.append(((*path, Step("cell", index)), cell.cell_contents))
                    except ValueError:  # an empty cell
                        continue
            elif isinstance(value, type):
                if value.__module__.split(".")[0] == "torch":
                    continue
                for key, item in vars(value).items():
                    if isinstance(item, types.FunctionType) and item.__code__ is code:
                        on_module = on_module or issubclass(value, torch.nn.Module)
                        if module_methods or not issubclass(value, torch.nn.Module):
                            hits.append((item, Location((*path, Step("attr", key)))))
            elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
                if type(value).__module__.split(".")[0] in ("torch", "IPython", "ipykernel"):
                    continue
                for key, item in list(vars(value).items())[:256]:
                    following.append(((*path, Step("attr", key)), item))
        frontier = following
    functions = {id(f): f for f, _ in hits}
    if len(functions) != 1:  # several closures from one factory: which one? ambiguous
        return None, [], on_module
    return hits[0][0], [loc for _, loc in hits], on_module
