"""MkDocs hooks for the moeref site (``mkdocs.yml``: ``hooks``).

Docstrings hold bare ``>>>`` examples (they run as doctests), which Markdown would render as
nested block quotes whose ``[...]`` output reads as reference links. :class:`DoctestBlocks`
turns every run of ``>>>`` lines outside a fenced block, with the output lines that follow it,
into a fenced ``pycon`` block. It is added to the Markdown extensions before mkdocstrings reads
them, so the API pages (rendered by mkdocstrings) and the hand-written pages get it alike.
"""
from __future__ import annotations

import re

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

_FENCE = re.compile(r"^\s*(```|~~~)")
_PROMPT = re.compile(r"^(\s*)>>> ")


class _DoctestPreprocessor(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        in_fence = False
        i = 0
        while i < len(lines):
            line = lines[i]
            if _FENCE.match(line):
                in_fence = not in_fence
                out.append(line)
                i += 1
                continue
            m = None if in_fence else _PROMPT.match(line)
            if m is None:
                out.append(line)
                i += 1
                continue
            indent = m.group(1)
            block = []
            while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
                block.append(lines[i][len(indent):])
                i += 1
            out += ["", indent + "```pycon", *(indent + b for b in block), indent + "```", ""]
        return out


class DoctestBlocks(Extension):
    """Markdown extension: bare doctest examples become fenced ``pycon`` code blocks."""

    def extendMarkdown(self, md):  # noqa: N802 - Markdown's name
        md.preprocessors.register(_DoctestPreprocessor(md), "moeref_doctest_blocks", 40)


@event_priority(100)  # before mkdocstrings copies the extension list
def on_config(config):
    config.markdown_extensions.append(DoctestBlocks())
    return config
