"""Run a command as an unprivileged user (``nobody``) from a root test session: what a user without root runs.

The interpreter may sit where only root can reach it (pyenv under ``/root``, mode 700). The command then
runs in a private mount namespace of its own (``unshare --mount``) where the first directory on the way to
the interpreter that others cannot enter is covered by an empty, open tmpfs holding just the interpreter's
tree again (bind mounts): nothing changes outside that namespace, which goes with the command.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import sys
from pathlib import Path

__all__ = ["NOBODY", "as_nobody", "unavailable"]

NOBODY = 65534


def unavailable() -> str | None:
    """Why a command cannot be run as nobody here, or None."""
    if os.geteuid() != 0:
        return "needs a root session to switch to nobody"
    missing = [tool for tool in ("unshare", "setpriv", "mount") if shutil.which(tool) is None]
    return f"needs {', '.join(missing)}" if missing else None


def _closed_ancestor(path: Path) -> Path | None:
    """The first directory on the way to ``path`` that others may not enter (no o+x), or None."""
    for parent in reversed(path.parents):
        if not parent.stat().st_mode & stat.S_IXOTH:
            return parent
    return None


def as_nobody(argv: list[str], workdir: Path, env: dict[str, str] | None = None) -> list[str]:
    """``argv`` wrapped to run as nobody (uid and gid 65534, no supplementary groups) with ``env`` set;
    ``workdir`` (the caller's to remove) holds the one mount point it needs."""
    interpreter = Path(sys.base_prefix).resolve()
    lines = ["set -e"]
    closed = _closed_ancestor(interpreter / "bin")
    if closed is not None:
        stash = shlex.quote(str(workdir / ".interpreter"))  # a mount point only this namespace sees mounted
        lines += [f"mkdir -p {stash}", f"mount --bind {shlex.quote(str(interpreter))} {stash}",
                  f"mount -t tmpfs -o mode=755 hybrid-open {shlex.quote(str(closed))}",
                  f"mkdir -p {shlex.quote(str(interpreter))}",
                  f"mount --bind {stash} {shlex.quote(str(interpreter))}"]
    settings = [f"{k}={v}" for k, v in (env or {}).items()]
    lines.append(f'exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups -- env {shlex.join(settings)} "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines), "sh", *argv]
