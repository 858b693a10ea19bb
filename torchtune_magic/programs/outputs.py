"""Whether two runs of a program printed the same thing: a script's output, or one notebook
cell's outputs. Used by `check --verify` and `scan --verify`, which run an original and its
optimized copy plainly and must tell a real difference from a clock reading.

Two things are masked, neither of them output a program computes. Wall-clock time: a
figure with a time unit ("3.2 s", "12ms"), a rate ("7.5it/s"), a clock reading ("00:01", a
progress bar's "[00:01<00:02, ...]"), or the figure after a word such as "time" or "took".
And the file name a kernel gives a cell's code (`/tmp/ipykernel_<pid>/<hash>.py`, new with
every kernel), which a warning's first line carries. A line counts as masked only where the
two runs differ in those alone; any other difference is reported with its first differing
line. Streams are compared as a terminal shows them (text before a carriage return is overwritten),
so a progress bar that redrew a different number of times still reads the same. Images are
compared by their decoded pixels, not their file bytes.
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_NUMBER = r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_UNIT = (
    r"(?:s|sec|secs|second|seconds|ms|msec|msecs|millisecond|milliseconds|us|µs|μs|ns"
    r"|min|mins|minute|minutes|h|hr|hrs|hour|hours)"
)
_RATE = r"(?:it|s|samples|batches|steps|examples|img|images|tokens)/(?:s|it|sec)"
_TIME_WORD = r"(?i:(?<!<)\b(?:time|took|elapsed|duration|runtime|wall)\b)"  # not our mark
_TIME = re.compile(
    "|".join(
        (
            r"\[\d+:\d+(?::\d+)?<[^\]]*\]",  # a progress bar's [elapsed<remaining, rate]
            rf"(?<![\w.]){_NUMBER}\s*{_RATE}",
            rf"(?<![\w.]){_NUMBER}\s*{_UNIT}\b",
            r"(?<![\w.:])\d{1,2}:\d{2}(?::\d{2})?(?:\.\d+)?(?![\w:])",  # 00:01, 1:02:03
        )
    )
)
_AFTER_TIME_WORD = re.compile(rf"({_TIME_WORD}[^\d\n<|,;]{{0,20}}?){_NUMBER}(?:\s*{_UNIT}\b)?")
MASK = "<time>"
_KERNEL_CELL_FILE = re.compile(r"[^\s\"']*ipykernel_\d+[/\\]-?\d+\.py")
CELL_FILE = "<cell file>"

# A notebook output's MIME types compared as text, and as decoded images
TEXT_TYPES = ("text/plain", "text/html", "text/markdown", "text/latex", "application/json")
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif")
# The live widget a progress bar (tqdm.auto) displays: a fresh model id every run; its
# text/plain form is what is compared
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@dataclass
class TextComparison:
    """The outcome of comparing an original run's output with another run's."""

    same: bool
    # the original's lines that differed only where masked
    masked: list[str] = field(default_factory=list)
    difference: str | None = None  # the first differing line, as the original has it

    def describe(self) -> str:
        if not self.same:
            return f"differs at: {self.difference}"
        if self.masked:
            return f"identical ({len(self.masked)} lines masked)"
        return "identical"


def masked(line: str) -> str:
    """`line` with its wall-clock figures and a kernel's cell file names replaced by marks."""
    line = _KERNEL_CELL_FILE.sub(CELL_FILE, _TIME.sub(MASK, line))
    return _AFTER_TIME_WORD.sub(lambda match: match.group(1) + MASK, line)


def as_shown(text: str) -> list[str]:
    """The lines a terminal shows for `text`: what a carriage return came before is gone."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines]


def compare_text(original: str, other: str) -> TextComparison:
    """Compare two runs' printed output, line by line as shown, wall-clock figures masked."""
    return compare_lines(as_shown(original), as_shown(other))


def compare_lines(original: list[str], other: list[str], numbered: bool = True) -> TextComparison:
    """Line by line; `numbered`: a difference names its line number (a script's output;
    a notebook cell's lines are its streams' and results', where the text says more)."""

    def _shown(line: str, index: int) -> str:
        return f"line {index + 1}: {line!r}" if numbered else repr(line)

    masked_lines = []
    for index, (mine, theirs) in enumerate(zip(original, other, strict=False)):
        if mine == theirs:
            continue
        if masked(mine) != masked(theirs):
            return TextComparison(False, masked_lines, _shown(mine, index))
        masked_lines.append(mine)
    if len(original) != len(other):
        if len(original) > len(other):
            where = _shown(original[len(other)], len(other))
            return TextComparison(False, masked_lines, f"{where} (missing from the other run)")
        extra = other[len(original)]
        return TextComparison(False, masked_lines, f"(the other run goes on) {extra!r}")
    return TextComparison(True, masked_lines)


def compare_outputs(original: list[dict[str, Any]], other: list[dict[str, Any]]) -> TextComparison:
    """Compare one notebook cell's outputs (nbformat dicts) from two runs.

    Each stream is compared as a whole (how a kernel splits a stream into outputs, and how
    stdout and stderr interleave, depends on timing); rich outputs and errors in order."""
    return compare_lines(_cell_lines(original), _cell_lines(other), numbered=False)


def _cell_lines(outputs: Iterable[dict[str, Any]]) -> list[str]:
    streams: dict[str, str] = {}
    rich: list[str] = []
    for output in outputs:
        kind = output.get("output_type")
        if kind == "stream":
            name = output.get("name", "stdout")
            streams[name] = streams.get(name, "") + _text(output.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            rich.extend(_data_lines(output.get("data", {})))
        elif kind == "error":
            rich.append(f"error: {output.get('ename', '')}: {output.get('evalue', '')}")
    lines = []
    for name in sorted(streams):
        lines.extend(f"{name}: {line}" for line in as_shown(streams[name]))
    return lines + rich


def _data_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    for mime in IMAGE_TYPES:
        if mime in data:
            lines.append(f"{mime}: {image_content(mime, _text(data[mime]))}")
    for mime in TEXT_TYPES:
        if mime in data:
            value = data[mime]
            text = value if isinstance(value, str | list) else repr(value)
            lines.extend(f"{mime}: {line}" for line in as_shown(_text(text)))
    if not lines and data and WIDGET_VIEW not in data:
        lines.extend(f"{mime}: {_text(data[mime])}" for mime in sorted(data))
    return lines


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def image_content(mime: str, encoded: str) -> str:
    """A digest of an image's content: a PNG's header and decompressed pixel rows (the
    same picture saved with other metadata or compression reads the same); other formats'
    bytes."""
    raw = base64.b64decode(encoded)
    if mime == "image/png":
        pixels = _png_pixels(raw)
        if pixels is not None:
            raw = pixels
    return hashlib.sha256(raw).hexdigest()[:16]


def _png_pixels(raw: bytes) -> bytes | None:
    """IHDR + the decompressed IDAT stream of a PNG; None where it is not a well-formed PNG."""
    if not raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    header, compressed, at = b"", [], 8
    while at + 8 <= len(raw):
        (length,) = struct.unpack(">I", raw[at : at + 4])
        kind, body = raw[at + 4 : at + 8], raw[at + 8 : at + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            compressed.append(body)
        at += 12 + length
    try:
        return header + zlib.decompress(b"".join(compressed))
    except zlib.error:
        return None
