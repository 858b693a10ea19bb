"""Line-level edits of the cell source, for live source fixes and the code changes shown.

Edits work on AST positions, keep the user's formatting everywhere else, and produce a
unified diff the renderers show as "the change to make".

Under a `%%perfcheck` line the cell's text starts with blank lines standing for the lines
above it in the editor (`Workload.first_line`), so AST positions, tracebacks and diff hunks
all count lines as the editor does; edits keep those blank lines in place.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Iterator

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def unified_diff(old: str, new: str, old_label: str = "cell", new_label: str = "") -> str:
    """A unified diff (one line of context). Blank context lines opening a hunk are left
    out: at the top of the cell they stand for the editor's `%%perfcheck` line and the
    blank lines after it, which the cell text only pads, and elsewhere they show nothing."""
    if old == new:
        return ""
    lines = list(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            old_label,
            new_label or f"{old_label} (optimized)",
            n=1,
        )
    )
    out = lines[:2]
    for line in lines[2:]:
        if line.startswith("@@") or not out[-1].startswith("@@") or line.strip():
            out.append(line)
        else:
            out[-1] = _shifted(out[-1])  # a blank context line right after the header
    return "".join(line if line.endswith("\n") else line + "\n" for line in out)


def _shifted(header: str) -> str:
    """A hunk header with its first (context) line left out."""
    match = _HUNK.match(header)
    if match is None:
        return header
    old_start, new_start = int(match.group(1)), int(match.group(3))
    old_len, new_len = int(match.group(2) or 1), int(match.group(4) or 1)
    return f"@@ -{_range(old_start + 1, old_len - 1)} +{_range(new_start + 1, new_len - 1)} @@\n"


def _range(start: int, length: int) -> str:
    """A unified-diff range as difflib writes it ("3", "3,2", or "2,0" for none)."""
    if length == 1:
        return str(start)
    if length == 0:
        return f"{start - 1},0"
    return f"{start},{length}"


def rebase(typed: str, python: str, edited: str) -> str | None:
    """Carry `edited` (an edit of `python`, which is IPython's transform of `typed`) onto
    `typed`: changed lines replace their typed counterparts, the rest stays as typed (a
    `%matplotlib` line stays a magic). None when the lines do not correspond (IPython's
    transform changed their number beyond dropping leading blank lines)."""
    if edited == python:
        return typed
    typed_lines, python_lines = typed.splitlines(), python.splitlines()
    lead = next((i for i, line in enumerate(typed_lines) if line.strip()), len(typed_lines))
    if len(typed_lines) - lead != len(python_lines):
        return None
    edited_lines = edited.splitlines()
    out = typed_lines[:lead]
    matcher = difflib.SequenceMatcher(a=python_lines, b=edited_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        out += typed_lines[lead + i1 : lead + i2] if tag == "equal" else edited_lines[j1:j2]
    return "\n".join(out) + ("\n" if typed.endswith("\n") else "")


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


def call_at(
    tree: ast.Module, line: int, names: set[str], col: int | None = None
) -> ast.Call | None:
    """The call of one of `names` that starts at `line` (and column `col`, when given)."""
    for call in calls_named(tree, names):
        if call.lineno == line and (col is None or call.col_offset == col):
            return call
    return None


def with_keywords(
    source: str,
    line: int,
    names: set[str],
    values: dict[str, str],
    positional: dict[str, int] | None = None,
    col: int | None = None,
) -> str:
    """The text with the call of `names` at `line` (and `col`) given these keyword values:
    a keyword already there, or an argument given by position (`positional`: keyword ->
    index), is replaced; otherwise the keyword is appended. Line starts do not move, so
    several such edits of one text can be made one after the other."""
    positional = positional or {}
    for key, text in values.items():
        call = call_at(ast.parse(source), line, names, col)
        if call is None:
            return source
        existing = next((k.value for k in call.keywords if k.arg == key), None)
        if existing is None and key in positional and len(call.args) > positional[key]:
            existing = call.args[positional[key]]
        if existing is not None:
            source = replace_node(source, existing, text)
            continue
        segment = ast.get_source_segment(source, call) or ""
        head = segment[: segment.rindex(")")].rstrip()
        joiner = "" if head.endswith(("(", ",")) else ", "
        if head.endswith(","):
            joiner = " "
        source = replace_node(source, call, f"{head}{joiner}{key}={text})")
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
