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
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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
    unambiguously it is dropped. Edits are dropped (clashing ones first) until the result
    parses.
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
    while True:  # a merge that does not parse loses its last clashing, then taken, edit
        merged = _merged(original, taken, clashing)
        if not (taken or clashing) or parses(merged):
            return merged
        (clashing or taken).pop()


def _merged(
    original: list[str],
    taken: list[tuple[int, int, list[str]]],
    clashing: list[tuple[int, int, list[str]]],
) -> str:
    """The original lines with the independent edits (bottom-up), then the clashing ones
    where their lines now stand."""
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


# edits on the concrete syntax tree -----------------------------------------------------------
# libcst keeps what `ast` drops (comments, line breaks, trailing commas, parentheses), so an
# edit rebuilds only the nodes it changes and the cell prints back as typed everywhere else.
# libcst is imported inside the functions that use it: importing the package stays quick.


class EditError(ValueError):
    """An edit that cannot be made to this cell; the message says why, in one line."""


Member = Callable[[Any], "list[Any]"]  # block statement -> statements and carried lines
Node = Callable[[Any], Any]  # a node as the edit leaves it -> its replacement


@dataclass(frozen=True)
class Wrap:
    """Block statements from one (the key of `Tree.wraps`) to `last` put under `header:`,
    `after` the statements to follow the new block."""

    last: Any
    header: str
    after: tuple[Any, ...] = ()


class Tree:
    """A cell's concrete syntax tree, where `ast` nodes are found by position, and the edits
    to make on it together: `nodes` replaces nodes, `members` replaces statements of a block
    by statements (an `EmptyLine` among them is carried to the next statement, so a comment
    above a removed statement stays), `wraps` puts runs of block statements under a header,
    `inserts` puts statements before a block statement (after the blank lines above it)."""

    def __init__(self, source: str):
        import libcst as cst
        from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

        try:
            wrapper = MetadataWrapper(cst.parse_module(source))
        except cst.ParserSyntaxError as error:
            raise EditError(f"the cell cannot be read for editing: {error.message}") from error
        self.source = source
        self.module = wrapper.module
        self.positions = wrapper.resolve(PositionProvider)
        self.parents = wrapper.resolve(ParentNodeProvider)
        self.nodes: dict[Any, Node] = {}
        self.members: dict[Any, Member] = {}
        self.wraps: dict[Any, Wrap] = {}
        self.inserts: dict[Any, list[Any]] = {}

    def node_for(self, node: ast.AST) -> Any:
        """The libcst node at the `ast` node's position (an expression for an expression,
        a statement for a statement); `ast` columns count UTF-8 bytes, libcst's characters."""
        import libcst as cst

        start, end = self._span(node)
        kinds: tuple[type, ...] = (cst.BaseExpression,)
        if isinstance(node, ast.stmt):
            kinds = (cst.BaseSmallStatement, cst.BaseCompoundStatement)
        found = [
            cst_node
            for cst_node, where in self.positions.items()
            if isinstance(cst_node, kinds)
            and (where.start.line, where.start.column) == start
            and (where.end.line, where.end.column) == end
        ]
        if not found:
            name = type(node).__name__
            raise EditError(f"no {name} at line {start[0]} to edit (the cell changed)")
        return found[-1]  # positions are recorded leaving nodes: the last is the outermost

    def _span(self, node: Any) -> tuple[tuple[int, int], tuple[int, int]]:
        """An `ast` node's (line, character column) start and end."""
        lines = self.source.splitlines(keepends=True)
        end_line = node.end_lineno or node.lineno
        return (
            (node.lineno, _byte_to_char(lines[node.lineno - 1], node.col_offset)),
            (end_line, _byte_to_char(lines[end_line - 1], node.end_col_offset or 0)),
        )

    def member_of(self, node: Any) -> Any:
        """The statement of a block (the cell, or an indented body) holding `node`."""
        import libcst as cst

        while not isinstance(self.parents.get(node), (cst.Module, cst.IndentedBlock)):
            if node not in self.parents:
                raise EditError("the statement to edit is not part of a block")
            node = self.parents[node]
        return node

    def run(self, first: int, last: int) -> tuple[Any, Any]:
        """The first and last statements of one block spanning lines first..last."""
        import libcst as cst

        for member, where in self.positions.items():
            block = self.parents.get(member)
            if not isinstance(block, (cst.Module, cst.IndentedBlock)) or member not in block.body:
                continue
            if first not in (where.start.line, self._first_line(member)):
                continue
            for other in block.body[block.body.index(member) :]:
                if self.positions[other].end.line == last:
                    return member, other
        raise EditError(f"lines {first}-{last} are not whole statements of one block")

    def _first_line(self, member: Any) -> int:
        """A statement's first line, its decorators included."""
        decorators = getattr(member, "decorators", ())
        return self.positions[decorators[0]].start.line if decorators else 0

    def code(self) -> str:
        """The cell with every edit made; EditError where it would not parse."""
        module = self.module.visit(_editor_class()(self))
        return checked(module.code)


def edited(source: str, edit: Callable[[str], str]) -> tuple[str, list[str]]:
    """`edit(source)` and no note, or, where the edit cannot be made, the source unchanged
    and a note saying why (a finding then shows no code change, and the reason)."""
    try:
        return edit(source), []
    except EditError as error:
        return source, [f"no change to the cell here: {error}"]


def checked(text: str) -> str:
    """`text`, which must parse: an edit never hands back a cell Python cannot run."""
    try:
        ast.parse(text)
    except SyntaxError as error:
        raise EditError(f"the edited cell would not parse: {error.msg}") from error
    return text


def parses(text: str) -> bool:
    """Whether both Python and libcst read `text` (what the next edit needs)."""
    import libcst as cst

    try:
        ast.parse(text)
        cst.parse_module(text)
    except (SyntaxError, ValueError, cst.ParserSyntaxError):
        return False
    return True


@functools.cache
def _editor_class() -> type:
    """The transformer making a `Tree`'s edits, defined on first use (libcst loads then)."""
    import libcst as cst

    class Editor(cst.CSTTransformer):
        """Replaces nodes, then rebuilds each block from its statements' replacements."""

        def __init__(self, tree: Tree):
            super().__init__()
            self.tree = tree

        def on_leave(self, original_node: Any, updated_node: Any) -> Any:
            make = self.tree.nodes.get(original_node)
            if make is not None:
                updated_node = make(updated_node)
            if isinstance(original_node, (cst.Module, cst.IndentedBlock)):
                updated_node = self._block(original_node, updated_node)
            return updated_node

        def _block(self, original: Any, updated: Any) -> Any:
            items: list[Any] = []
            wrap: Wrap | None = None
            wrapped: list[Any] = []
            for before, after in zip(original.body, updated.body, strict=True):
                inserted = self.tree.inserts.get(before, [])
                if inserted:  # ahead of a block starting here, under the blank lines above
                    above, own = split_leading(after.leading_lines)
                    (wrapped if wrap is not None else items).extend([*above, *inserted])
                    after = after.with_changes(leading_lines=own)
                wrap = self.tree.wraps.get(before, wrap)
                made = self.tree.members.get(before, lambda s: [s])(after)
                (wrapped if wrap is not None else items).extend(made)
                if wrap is not None and before is wrap.last:
                    items += _wrapped(wrapped, wrap)
                    wrap, wrapped = None, []
            if wrap is not None:
                raise EditError("the lines to wrap end inside another block")
            body, carried = settle(items)
            if isinstance(updated, cst.IndentedBlock) and not body:
                body, carried = [cst.SimpleStatementLine([cst.Pass()], leading_lines=carried)], []
            return updated.with_changes(body=body, footer=[*carried, *updated.footer])

    return Editor


def settle(items: list[Any]) -> tuple[list[Any], list[Any]]:
    """Statements with the `EmptyLine`s among them moved onto the next statement's leading
    lines; those after the last statement are returned apart (a block's footer)."""
    import libcst as cst

    body: list[Any] = []
    pending: list[Any] = []
    for item in items:
        if isinstance(item, cst.EmptyLine):
            pending.append(item)
        else:
            body.append(item.with_changes(leading_lines=[*pending, *item.leading_lines]))
            pending = []
    return body, pending


def _wrapped(items: list[Any], wrap: Wrap) -> list[Any]:
    """The statements under `wrap.header:` (the first one's leading lines stay above the
    header), then `wrap.after`."""
    import libcst as cst

    body, footer = settle(items)
    if not body:
        raise EditError("no statement left to wrap")
    header = cst.parse_statement(f"{wrap.header}:\n    pass\n")
    block = cst.IndentedBlock(
        body=[body[0].with_changes(leading_lines=[]), *body[1:]], footer=footer
    )
    wrapper = header.with_changes(body=block, leading_lines=body[0].leading_lines)
    return [wrapper, *wrap.after]


def statements(text: str) -> list[Any]:
    """`text` as block statements; EditError when it is not Python."""
    import libcst as cst

    try:
        return list(cst.parse_module(text.rstrip("\n") + "\n").body)
    except cst.ParserSyntaxError as error:
        raise EditError(f"the new code does not parse: {text.strip()}") from error


def expression(text: str, like: Any = None) -> Any:
    """`text` as an expression, inside the parentheses `like` (the node it replaces) had."""
    import libcst as cst

    try:
        new = cst.parse_expression(text)
    except cst.ParserSyntaxError as error:
        raise EditError(f"the new code does not parse: {text.strip()}") from error
    if like is not None and like.lpar and not new.lpar:
        new = new.with_changes(lpar=like.lpar, rpar=like.rpar)
    return new


def split_leading(lines: Any) -> tuple[list[Any], list[Any]]:
    """Leading lines split into those above a blank line and the comment lines right above
    the statement (which belong to it: a line inserted before it goes between the two)."""
    lines = list(lines)
    own = len(lines)
    while own and lines[own - 1].comment is not None:
        own -= 1
    return lines[:own], lines[own:]


def remove_statement(source: str, tree: ast.Module, node: ast.stmt) -> str:
    """Delete a statement (`pass` where it leaves a block empty); the comment lines above
    it stay, a comment on its own line goes with it. `tree` is `source`'s ast, for callers
    that hold it; the edit reads the libcst tree."""
    del tree
    edits = Tree(source)
    small = edits.node_for(node)
    member = edits.member_of(small)
    if member is small or len(member.body) == 1:
        edits.members[member] = lambda stmt: list(stmt.leading_lines)
    else:  # `a; b` on one line, or a one-line block `if x: a`
        owner = edits.parents[small]
        index = owner.body.index(small)
        edits.nodes[owner] = lambda suite: suite.with_changes(body=_without(suite.body, index))
    return edits.code()


def _without(body: Any, index: int) -> list[Any]:
    """Small statements of one line but the one at `index` (`pass` if none is left)."""
    import libcst as cst

    rest = [s for i, s in enumerate(body) if i != index]
    if not rest:
        return [cst.Pass()]
    return [*rest[:-1], rest[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]


def unwrap_with(source: str, node: ast.With) -> str:
    """Replace `with X: body` by the body at the `with` statement's indentation (libcst
    re-indents it); a comment on the `with` line becomes a comment line above the body."""
    edits = Tree(source)
    edits.members[edits.node_for(node)] = _unwrapped
    return edits.code()


def _unwrapped(statement: Any) -> list[Any]:
    """A `with` statement's body, its leading and header comment lines carried along."""
    import libcst as cst

    body = statement.body
    if isinstance(body, cst.SimpleStatementSuite):  # `with x: f()`
        line = cst.SimpleStatementLine(body.body, trailing_whitespace=body.trailing_whitespace)
        return [*statement.leading_lines, line]
    header = []
    if body.header.comment is not None:
        header = [cst.EmptyLine(comment=body.header.comment)]
    return [*statement.leading_lines, *header, *body.body, *body.footer]


def wrap_lines(source: str, first: int, last: int, header: str) -> str:
    """Put the statements on 1-based lines first..last (whole statements of one block)
    inside `header:` (e.g. `with torch.no_grad()`)."""
    edits = Tree(source)
    start, end = edits.run(first, last)
    edits.wraps[start] = Wrap(end, header)
    return edits.code()


def insert_after_imports(source: str, line: str) -> str:
    """The cell with `line` (a process-wide setting) as its first statement after imports
    (blank lines above the first statement stay on top, the comment right above it with it)."""
    edits = Tree(source)
    new = statements(line)
    body = edits.module.body
    rest = [s for s in body if not _imports(s)]
    if rest:
        edits.inserts[rest[0]] = new
    elif body:
        edits.members[body[-1]] = lambda stmt: [stmt, *new]
    else:
        return checked(edits.module.with_changes(body=new).code)
    return edits.code()


def _imports(statement: Any) -> bool:
    import libcst as cst

    return isinstance(statement, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body
    )


def add_decorator(source: str, node: ast.FunctionDef | ast.AsyncFunctionDef, text: str) -> str:
    """`@text` right above the `def` line, under any other decorator (a staticmethod must
    stay outermost)."""
    import libcst as cst

    edits = Tree(source)
    decorator = cst.Decorator(expression(text))
    edits.nodes[edits.node_for(node)] = lambda d: d.with_changes(
        decorators=[*d.decorators, decorator]
    )
    return edits.code()


def replace_node(source: str, node: ast.AST, text: str) -> str:
    """Replace the node (an expression or a statement) by `text`."""
    return replace_nodes(source, [(node, text)])


def replace_nodes(source: str, edits: list[tuple[ast.AST, str]]) -> str:
    """Several `replace_node` edits at once, made on one tree."""
    import libcst as cst

    tree = Tree(source)
    for node, text in edits:
        target = tree.node_for(node)
        if isinstance(target, cst.BaseExpression):
            new = expression(text, target)
            tree.nodes[target] = lambda _, new=new: new
            continue
        new_statements = statements(text)
        only = new_statements[0] if len(new_statements) == 1 else None
        if isinstance(target, cst.BaseSmallStatement) and _one_small(only):
            small = only.body[0]  # type: ignore[union-attr]
            tree.nodes[target] = lambda old, small=small: small.with_changes(
                semicolon=old.semicolon
            )
            continue
        member = tree.member_of(target)
        if member is not target and len(member.body) != 1:
            raise EditError(f"line {node.lineno} holds other statements too")  # type: ignore[attr-defined]
        tree.members[member] = lambda old, new=new_statements: [
            new[0].with_changes(leading_lines=old.leading_lines),
            *new[1:],
        ]
    return tree.code()


def _one_small(statement: Any) -> bool:
    import libcst as cst

    return isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1


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
    index), is replaced; otherwise the keyword is appended, in the call's own layout (one
    argument per line stays so). The text as it is when there is no such call. Appending
    to a call written one argument per line adds lines: edit the last call first."""
    try:
        call = call_at(ast.parse(source), line, names, col)
    except SyntaxError as error:
        raise EditError(f"the cell does not parse: {error.msg}") from error
    if call is None:
        return source
    tree = Tree(source)
    tree.nodes[tree.node_for(call)] = lambda node: _with_arguments(node, values, positional or {})
    return tree.code()


def with_keyword_renamed(
    source: str, line: int, names: set[str], old: str, new: str, text: str
) -> str:
    """The text with the call of `names` at `line` given `new=text` in the place of its
    `old=` argument (a keyword that must go when `new` comes, as `shuffle=` does when
    `sampler=` comes), or appended where it has none (`with_keywords`)."""
    import libcst as cst

    try:
        call = call_at(ast.parse(source), line, names)
    except SyntaxError as error:
        raise EditError(f"the cell does not parse: {error.msg}") from error
    if call is None or not any(keyword.arg == old for keyword in call.keywords):
        return with_keywords(source, line, names, {new: text})
    tree = Tree(source)

    def renamed(node: Any) -> Any:
        args = [
            arg.with_changes(keyword=cst.Name(new), value=expression(text))
            if arg.keyword is not None and arg.keyword.value == old
            else arg
            for arg in node.args
        ]
        return node.with_changes(args=args)

    tree.nodes[tree.node_for(call)] = renamed
    return tree.code()


def _with_arguments(call: Any, values: dict[str, str], positional: dict[str, int]) -> Any:
    """The libcst call with these keyword values, replaced where given, else appended."""
    import libcst as cst

    args = list(call.args)
    appended = []
    tight = cst.AssignEqual(
        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
    )
    for key, text in values.items():
        at = _argument_index(args, key, positional.get(key))
        if at is None:
            appended.append(cst.Arg(expression(text), keyword=cst.Name(key), equal=tight))
        else:
            args[at] = args[at].with_changes(value=expression(text, args[at].value))
    return _appended(call.with_changes(args=args), appended)


def _argument_index(args: list[Any], key: str, position: int | None) -> int | None:
    """Where the call gives `key`: as that keyword, or at `position` among positional
    arguments; EditError when a `*args` before it hides which argument that is."""
    for i, arg in enumerate(args):
        if arg.keyword is not None and arg.keyword.value == key:
            return i
    if position is None:
        return None
    plain = [i for i, arg in enumerate(args) if arg.keyword is None and not arg.star]
    unpacked = [i for i, arg in enumerate(args) if arg.star == "*"]
    if len(plain) <= position:
        if unpacked:
            raise EditError(f"the call's *{_name_of(args[unpacked[0]])} may already give {key}")
        return None
    if unpacked and unpacked[0] < plain[position]:
        raise EditError(f"the call's *{_name_of(args[unpacked[0]])} hides which argument is {key}")
    return plain[position]


def _name_of(arg: Any) -> str:
    import libcst as cst

    return cst.Module([]).code_for_node(arg.value)


def _appended(call: Any, new: list[Any]) -> Any:
    """The call with arguments `new` after its last one. A call written one argument per
    line gets one per line at the same indentation, the comment after the last argument
    staying on its line; a trailing comma stays last."""
    import libcst as cst

    if not new:
        return call
    args = list(call.args)
    if not args:
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        return call.with_changes(args=[*(a.with_changes(comma=comma) for a in new[:-1]), new[-1]])
    last = args[-1]
    trailing = isinstance(last.comma, cst.Comma)
    tail = last.comma.whitespace_after if trailing else last.whitespace_after_arg
    indent = _argument_indent(call)
    between: Any = cst.SimpleWhitespace(" ")
    first, end = between, tail
    if indent is not None:
        between = cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(indent))
        first, end = between, tail
        if isinstance(tail, cst.ParenthesizedWhitespace):  # the comment stays on its line
            first = tail.with_changes(indent=True, last_line=cst.SimpleWhitespace(indent))
            end = tail.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
    kept = last.comma.whitespace_before if trailing else cst.SimpleWhitespace("")
    args[-1] = last.with_changes(
        comma=cst.Comma(whitespace_before=kept, whitespace_after=first),
        whitespace_after_arg=cst.SimpleWhitespace(""),
    )
    for arg in new[:-1]:
        args.append(arg.with_changes(comma=cst.Comma(whitespace_after=between)))
    if trailing:
        args.append(new[-1].with_changes(comma=cst.Comma(whitespace_after=end)))
    else:
        args.append(new[-1].with_changes(whitespace_after_arg=end))
    return call.with_changes(args=args)


def _argument_indent(call: Any) -> str | None:
    """The indentation of a call written one argument per line (every argument after a
    line break), else None."""
    import libcst as cst

    args = call.args
    breaks = [a.comma.whitespace_after for a in args[:-1]]
    if len(args) == 1:
        breaks = [call.whitespace_before_args]
    if not all(isinstance(b, cst.ParenthesizedWhitespace) and b.indent for b in breaks):
        return None
    return breaks[-1].last_line.value


def _byte_to_char(line: str, offset: int) -> int:
    """A UTF-8 byte offset in `line` (as `ast` counts columns) as a character offset."""
    return len(line.encode()[:offset].decode(errors="ignore"))


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
