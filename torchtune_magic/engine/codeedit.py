"""Line-level edits of the cell source, for live source fixes and the code changes shown.

Edits work on AST positions, keep the user's formatting everywhere else, and produce a
unified diff the renderers show as "the change to make".
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterator


def unified_diff(old: str, new: str) -> str:
    if old == new:
        return ""
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        "cell",
        "cell (optimized)",
        n=1,
    )
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def combine(source: str, fixed_versions: list[str]) -> str:
    """One cell with every fix's edit applied (each version was edited from `source`).

    Edits are line ranges of the original, applied bottom-up. An edit overlapping one
    already taken (e.g. a line changed inside a block another fix re-indents) is applied
    afterwards where its lines now stand, re-indented to match; if they cannot be found
    unambiguously it is dropped, so the result parses as well as the versions do.
    """
    original = source.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []
    for version in fixed_versions:
        new = version.splitlines(keepends=True)
        matcher = difflib.SequenceMatcher(a=original, b=new, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag != "equal":
                edits.append((i1, i2, new[j1:j2]))
    taken: list[tuple[int, int, list[str]]] = []
    clashing: list[tuple[int, int, list[str]]] = []
    for edit in edits:
        start, end, _ = edit
        clashes = any(
            (start < t_end and t_start < end) or (start == end == t_start == t_end)
            for t_start, t_end, _ in taken
        )
        (clashing if clashes else taken).append(edit)
    lines = list(original)
    for start, end, replacement in sorted(taken, key=lambda e: (e[0], e[1]), reverse=True):
        lines[start:end] = replacement
    for start, end, replacement in clashing:
        lines = _apply_where_moved(lines, original[start:end], replacement)
    return "".join(lines)


def _apply_where_moved(lines: list[str], old: list[str], new: list[str]) -> list[str]:
    """Replace the one block of `lines` that reads `old` up to indentation by `new`,
    shifted by the indentation that block gained or lost."""
    if not old:
        return lines
    wanted = [line.strip() for line in old]
    hits = [
        i
        for i in range(len(lines) - len(old) + 1)
        if [line.strip() for line in lines[i : i + len(old)]] == wanted
    ]
    if len(hits) != 1:
        return lines
    at = hits[0]
    was, now = _indent_of(old[0]), _indent_of(lines[at])
    shifted = [
        now + line[len(was) :] if line.startswith(was) and line.strip() else line for line in new
    ]
    return lines[:at] + shifted + lines[at + len(old) :]


def _indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _only_statement(tree: ast.Module, node: ast.stmt) -> bool:
    for parent in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and node in block:
                return len(block) == 1
    return False


def remove_statement(source: str, tree: ast.Module, node: ast.stmt) -> str:
    """Delete a statement (replaced by `pass` when it is alone in its block)."""
    lines = source.splitlines(keepends=True)
    first, last = node.lineno - 1, node.end_lineno or node.lineno
    replacement = []
    if _only_statement(tree, node) and not isinstance(_parent_of(tree, node), ast.Module):
        replacement = [_indent_of(lines[first]) + "pass\n"]
    return "".join(lines[:first] + replacement + lines[last:])


def unwrap_with(source: str, node: ast.With) -> str:
    """Replace `with X: body` by the body, dedented to the `with` line's indentation."""
    lines = source.splitlines(keepends=True)
    header_first, body_first = node.lineno - 1, node.body[0].lineno - 1
    last = node.end_lineno or node.lineno
    outer = _indent_of(lines[header_first])
    inner = _indent_of(lines[body_first])
    body = [
        outer + line[len(inner) :] if line.startswith(inner) else line
        for line in lines[body_first:last]
    ]
    return "".join(lines[:header_first] + body + lines[last:])


def wrap_lines(source: str, first: int, last: int, header: str) -> str:
    """Put 1-based lines first..last inside `header:` (e.g. `with torch.no_grad()`)."""
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    indent = _indent_of(lines[first - 1])
    body = ["    " + line if line.strip() else line for line in lines[first - 1 : last]]
    return "".join([*lines[: first - 1], f"{indent}{header}:\n", *body, *lines[last:]])


def insert_after_imports(source: str, line: str) -> str:
    """The cell with `line` (a process-wide setting) as its first statement after imports
    (blank lines above the first statement stay on top)."""
    body = ast.parse(source).body
    after = len(source.splitlines())
    for node in body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            starts = [node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]
            after = min(starts) - 1
            break
        after = node.end_lineno or node.lineno
    lines = source.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join([*lines[:after], line.rstrip("\n") + "\n", *lines[after:]])


def replace_node(source: str, node: ast.AST, text: str) -> str:
    """Replace the exact source span of `node` by `text`."""
    lines = source.splitlines(keepends=True)
    start = sum(len(line) for line in lines[: node.lineno - 1]) + _byte_to_char(
        lines[node.lineno - 1], node.col_offset
    )
    end_line = node.end_lineno or node.lineno
    end = sum(len(line) for line in lines[: end_line - 1]) + _byte_to_char(
        lines[end_line - 1], node.end_col_offset or 0
    )
    return source[:start] + text + source[end:]


def replace_nodes(source: str, edits: list[tuple[ast.AST, str]]) -> str:
    """Several `replace_node` edits at once (applied bottom-up so positions stay valid)."""
    ordered = sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True)
    for node, text in ordered:
        source = replace_node(source, node, text)
    return source


def _byte_to_char(line: str, offset: int) -> int:
    return len(line.encode()[:offset].decode(errors="ignore"))


def _parent_of(tree: ast.Module, target: ast.AST) -> ast.AST | None:
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            if child is target:
                return parent
    return None


def top_statement_at(tree: ast.Module, line: int) -> ast.stmt | None:
    """The outermost cell statement containing `line`."""
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return node
    return None


def dotted_name(node: ast.AST) -> str:
    """`torch.autograd.detect_anomaly` for an Attribute/Name chain, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def calls_named(tree: ast.Module, names: set[str]) -> Iterator[ast.Call]:
    """Calls whose callee's last name is in `names` (`x.y.detect_anomaly(...)`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            last = dotted_name(node.func).rsplit(".", 1)[-1]
            if last in names:
                yield node


def statement_of(tree: ast.Module, target: ast.AST) -> ast.stmt | None:
    """The innermost statement that contains `target`."""
    best: ast.stmt | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or not any(n is target for n in ast.walk(node)):
            continue
        if best is None or (node.lineno, -(node.end_lineno or 0)) >= (
            best.lineno,
            -(best.end_lineno or 0),
        ):
            best = node
    return best
