"""The programs of examples/ as the docs show them: each page's ```python block that is an example file, verbatim,
and the ```bash block after it, the command a reader copies."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["EXAMPLES", "REPO", "commands_on", "examples_on"]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {path.name: path.read_text() for path in sorted((REPO / "examples").glob("*.py"))}


def _blocks(page: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", (REPO / page).read_text(), flags=re.S)


def examples_on(page: str) -> dict[str, str]:
    """{example file name: the command after it} for every example shown verbatim on ``page``."""
    found, blocks = {}, _blocks(page)
    for i, (lang, body) in enumerate(blocks):
        name = next((n for n, text in EXAMPLES.items() if lang == "python" and body == text), None)
        if name is None:
            continue
        command = next((b for lang_after, b in blocks[i + 1:] if lang_after == "bash"), None)
        if command is None or f"examples/{name}" not in command:
            raise AssertionError(f"{page}: examples/{name} is shown without the command that runs it")
        found[name] = command.strip()
    return found


def commands_on(page: str) -> list[str]:
    return [body.strip() for lang, body in _blocks(page) if lang == "bash"]
