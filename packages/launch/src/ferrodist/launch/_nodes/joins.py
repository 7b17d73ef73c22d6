"""The join directory of an elastic job of several nodes (``-n MIN:MAX --nnodes N``), kept the
same on every node by the launchers.

A replacement of a lost rank writes where it listens in its own node's join directory, and
the group that takes it in answers in the directory of whichever node its lowest member runs
on (``ferrodist.collectives``' ``_failures.replacements``). Each launcher looks at its
directory at every turn of its supervisor (``changes``: the files its ranks wrote or removed
since the last look) and sends each change to the other nodes over the control channel (the
hub passes a member's on to the others); a launcher applies the changes it receives
(``apply``), writing a file aside and renaming it, so a rank reads a whole file or none.

A change carries the content it replaced. A file written always wins (a replacement's word,
or the group's answer, is the newest); a removal is applied only where the file still holds
what was removed, so a member's "forget the replacement that died" crossing a new
replacement's word for the same rank does not erase the new word.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["LOOK", "Joins"]

#: Seconds between a launcher's looks at its join directory.
LOOK = 0.1

#: The files of the join directory (anything else there, or named by a peer, is left alone).
_NAME = re.compile(r"(joiner|group)-\d{1,9}\.json")
_LARGEST = 1 << 16


class Joins:
    """One node's join directory, and what it last agreed with the other nodes'."""

    def __init__(self, place: str | os.PathLike[str]) -> None:
        self.place = Path(place)
        self._known: dict[str, str] = {}  # name -> content, as every node has it

    def _read(self, name: str) -> str | None:
        try:
            with open(self.place / name, encoding="utf-8") as f:
                return f.read(_LARGEST)
        except (OSError, ValueError):
            return None

    def _here(self) -> dict[str, str]:
        found: dict[str, str] = {}
        try:
            names = os.listdir(self.place)
        except OSError:
            return found
        for name in names:
            if _NAME.fullmatch(name) and (text := self._read(name)) is not None:
                found[name] = text
        return found

    def changes(self) -> list[dict[str, str | None]]:
        """The files this node's ranks wrote or removed since the last look, as messages
        (``name``, the new ``text`` or None, and the text it replaced, ``was``)."""
        here = self._here()
        news: list[dict[str, str | None]] = [
            {"name": name, "text": text, "was": self._known.get(name)}
            for name, text in sorted(here.items())
            if self._known.get(name) != text
        ]
        news += [
            {"name": name, "text": None, "was": was} for name, was in sorted(self._known.items()) if name not in here
        ]
        self._known = here
        return news

    def apply(self, message: dict[str, object]) -> bool:
        """Another node's change (see the module's docstring); True if it changed this node's
        directory (a malformed message, or a removal of what is no longer here, does not)."""
        name, text, was = message.get("name"), message.get("text"), message.get("was")
        if not (isinstance(name, str) and _NAME.fullmatch(name)) or not isinstance(text, (str, type(None))):
            return False
        path = self.place / name
        if text is None:
            here = self._read(name)
            if here is None:
                self._known.pop(name, None)
            if here != was:
                return False
            path.unlink(missing_ok=True)
            self._known.pop(name, None)
            return True
        aside = self.place / f".{name}.launcher"
        aside.write_text(text, encoding="utf-8")
        os.replace(aside, path)
        self._known[name] = text
        return True
