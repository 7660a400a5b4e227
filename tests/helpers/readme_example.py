"""The worked example of docs/your-model.md (section "Worked example"), read from that page itself: its files
and its command, so the tests run exactly what a reader copies."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "your-model.md"
SECTION = "## Worked example"


def example() -> tuple[dict[str, str], str]:
    """The section's files (fenced blocks whose first line is ``# <relative path>``) and its one command."""
    text = PAGE.read_text()
    start = text.index(SECTION)
    following = re.search(r"\n#{2,3} ", text[start + len(SECTION):])  # the next heading (code has single #)
    section = text[start:start + len(SECTION) + following.start() if following else None]
    files, commands = {}, []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        first, _, rest = body.partition("\n")
        if lang == "bash":
            commands.append(body.strip())
        elif first.startswith("# ") and "/" in first:
            files[first[2:].strip()] = body
    if len(commands) != 1 or not files:
        raise AssertionError(f"{PAGE.name} section {SECTION!r}: expected files and one command, got {len(commands)}")
    return files, commands[0]


def write_example(directory: Path) -> str:
    """Write the example's files under ``directory``; return its command."""
    files, command = example()
    for name, body in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    return command
