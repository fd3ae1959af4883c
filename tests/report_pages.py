"""The docs-page round trip of the bench/report_*.py scripts, for their CPU tests: a small page with the
script's markers around stale text, rendered from a hand-written JSON through the script's ``main``."""
from __future__ import annotations

import json


def page_with_markers(marker: str) -> str:
    """A page whose generated part (``<!-- {marker}:begin/end -->``) holds stale text between hand text."""
    return f"# title\n\nhand text\n\n<!-- {marker}:begin -->\nold table\n<!-- {marker}:end -->\n\nafter\n"


def rendered(main, tmp_path, data: dict, marker: str) -> str:
    """The page after ``main([json, "--docs", page])``: ``--check`` fails before, passes after (stable)."""
    js, page = tmp_path / "bench.json", tmp_path / "page.md"
    js.write_text(json.dumps(data))
    page.write_text(page_with_markers(marker))
    assert main([str(js), "--docs", str(page), "--check"]) == 1  # differs before
    assert main([str(js), "--docs", str(page)]) == 0
    assert main([str(js), "--docs", str(page), "--check"]) == 0  # and is stable
    return page.read_text()
