"""Compiling outside the caller's process: a helper process that fills Numba's disk cache.

Numba compiles in Python for the most part, holding the GIL: a compile on a rank's
background thread took the GIL from the training thread for seconds at a time (torch DDP
steps of a small model went from 1.5 ms to 8-13 ms while it ran), and every rank of a host
compiled the same code at once. Here a rank's compile thread hands the compile to a helper
process of its own (:class:`Helper`, started on the first cache miss, at a low CPU
priority) and waits for it without holding the GIL; the helper writes the code to the disk
cache, and the rank then loads it (milliseconds).

A host compiles each function once: every process that compiles one of ferrodist's
functions into a cache holds that function's lock there (:func:`compile_here`), so the
second rank's helper waits for the first and loads its code instead of compiling it again.

A helper gets the dispatcher the same way the rank did, by a :class:`Recipe`: the module
and name of a module-level dispatcher, or of the factory that made it and the factory's
arguments. A dispatcher without one compiles in the rank's own process, as before.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from .jit import SafeCache

__all__ = ["Helper", "Recipe", "compile_here", "in_cache", "made_by", "main"]

#: The helper's CPU priority (``nice``): below the ranks, so that a job's own work goes
#: first where cores are short, but not so low that a crowded host never compiles.
NICE = 10


@dataclass(frozen=True)
class Recipe:
    """How another process gets the same dispatcher: ``module.name``, called with ``args``
    when ``args`` is not None (a factory such as ``fold_kernel``)."""

    module: str
    name: str
    args: tuple[Any, ...] | None = None

    def dispatcher(self) -> Any:
        found = getattr(importlib.import_module(self.module), self.name)
        return found if self.args is None else found(*self.args)

    @classmethod
    def of(cls, dispatcher: Any) -> Recipe | None:
        """The recipe of a dispatcher that a factory declared (:func:`made_by`), or of one
        bound to a name of its module; None for any other."""
        declared = _DECLARED.get(id(dispatcher))
        if declared is not None and declared[0] is dispatcher:
            return declared[1]
        fn = dispatcher.py_func
        module = sys.modules.get(fn.__module__)
        if fn.__module__ == "__main__":
            return None  # another process's __main__ is another script
        if module is not None and getattr(module, fn.__qualname__, None) is dispatcher:
            return cls(fn.__module__, fn.__qualname__)
        return None


#: Dispatchers made by factories, with their recipes (by id; the dispatcher is kept, so its
#: id stays its own). Facts that never change: nothing to reset.
_DECLARED: dict[int, tuple[Any, Recipe]] = {}


def made_by(dispatcher: Any, recipe: Recipe) -> Any:
    """Declare how another process makes ``dispatcher`` (a factory's product, such as
    ``fold_kernel(kind, op, divide, place)``); returns ``dispatcher``. The factory must
    give equal dispatchers for equal arguments in every process (cache it)."""
    _DECLARED[id(dispatcher)] = (dispatcher, recipe)
    return dispatcher


def in_cache(dispatcher: Any, types: tuple[Any, ...]) -> bool:
    """Whether the disk cache holds ``dispatcher``'s code for ``types`` (a read of its index;
    False for a dispatcher without ferrodist's cache, such as ``jit(cache=False)``)."""
    cache = dispatcher._cache
    return isinstance(cache, SafeCache) and cache.holds(types, dispatcher.targetctx)


def compile_here(dispatcher: Any, types: tuple[Any, ...]) -> Any:
    """Compile ``dispatcher`` for ``types`` in this process (or load it from the disk cache),
    holding the function's lock of this host's cache while doing so; its compile result."""
    cache = dispatcher._cache
    with cache.compile_lock() if isinstance(cache, SafeCache) else contextlib.nullcontext():
        dispatcher.compile(types)
    return dispatcher.overloads[tuple(types)]


class HelperGone(Exception):
    """The helper process could not be started, or went away."""


def _send(fd: int, message: Any) -> None:
    """One message on a pipe: its length, then its pickle (plain ``os`` calls on the file
    descriptor: no Python file object, whose lock a forked child could find held)."""
    data = pickle.dumps(message)
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data) :]


def _receive(fd: int) -> Any:
    """The next message :func:`_send` wrote; ``EOFError`` at the end of the pipe."""

    def exactly(n: int) -> bytes:
        parts, left = [], n
        while left:
            part = os.read(fd, left)  # the GIL is released while it waits
            if not part:
                raise EOFError("the pipe ended")
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    return pickle.loads(exactly(int.from_bytes(exactly(8), "little")))


class Helper:
    """One helper process, started on the first request; requests are answered in order.
    Used from one thread (the compile thread); :meth:`close` may come from any."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._requests = -1  # the pipe's ends this process holds (-1: none)
        self._replies = -1
        self._lock = threading.Lock()
        self.broken = False  # could not start, or died: the caller compiles itself

    def compile(self, recipe: Recipe, types: tuple[Any, ...]) -> str | None:
        """Have the helper compile ``recipe``'s dispatcher for ``types`` into the disk cache
        and wait for it (without the GIL). Returns None when done, or why the compile
        failed there; raises :class:`HelperGone` when there is no helper to ask, or when it
        cannot make the dispatcher from the recipe (the caller then compiles itself)."""
        requests, replies = self._started()
        try:
            _send(requests, (recipe, types))
            status, reason = _receive(replies)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
            self.broken = True
            raise HelperGone(f"the compile helper went away ({type(exc).__name__})") from exc
        if status == "unknown":
            raise HelperGone(f"the compile helper cannot make {recipe.module}.{recipe.name}: {reason}")
        return None if status == "ok" else str(reason)

    def _started(self) -> tuple[int, int]:
        with self._lock:
            if self.broken:
                raise HelperGone("no compile helper")
            if self._process is not None:
                return self._requests, self._replies
            request_read, request_write = os.pipe()
            reply_read, reply_write = os.pipe()
            try:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "ferrodist.core._compile.helper", str(request_read), str(reply_write)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(request_read, reply_write),
                    env=_helper_env(),
                )
            except OSError as exc:
                os.close(request_write)
                os.close(reply_read)
                self.broken = True
                raise HelperGone(f"the compile helper did not start ({exc})") from exc
            finally:
                os.close(request_read)
                os.close(reply_write)
            self._requests, self._replies = request_write, reply_read
            return self._requests, self._replies

    def close(self, *, wait: bool = False) -> None:
        """Let the helper go: it ends after the compile in progress (its code still reaches
        the cache, for the next process) or at once when idle. ``wait``: until it has."""
        with self._lock:
            process, self._process = self._process, None
            requests, self._requests = self._requests, -1
            self.broken = True
        if process is None:
            return
        with contextlib.suppress(OSError):
            os.close(requests)  # the helper reads the end of its requests
        if wait:  # nobody reads the replies then (the compile thread may, at an exit)
            process.wait()
            replies, self._replies = self._replies, -1
            with contextlib.suppress(OSError):
                os.close(replies)

    def forget(self) -> None:
        """In a forked child: drop this process's copies of the parent's pipes (the helper
        ends when the parent closes its end, not when every forked child has)."""
        for fd in (self._requests, self._replies):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._process, self._requests, self._replies = None, -1, -1
        self._lock = threading.Lock()  # the parent's may have been held by its compile thread
        self.broken = False


def _helper_env() -> dict[str, str]:
    """The caller's environment, with the folders ferrodist's packages import from first
    on ``PYTHONPATH`` (a caller may have put them on ``sys.path`` by hand)."""
    import ferrodist

    env = dict(os.environ)
    roots = [os.path.dirname(path) for path in ferrodist.__path__]
    if env.get("PYTHONPATH"):
        roots.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(roots)
    return env


def main(requests: int, replies: int) -> None:
    """The helper: for each ``(recipe, types)`` read from ``requests``, compile into the
    disk cache (:func:`compile_here`) and answer ``("ok", None)`` or ``("failed", reason)``
    on ``replies``, until the requests end."""
    with contextlib.suppress(OSError):
        os.nice(NICE)
    while True:
        try:
            recipe, types = _receive(requests)
        except (EOFError, OSError):
            return
        answer: tuple[str, str | None] = ("ok", None)
        try:
            dispatcher = recipe.dispatcher()
        except Exception as exc:  # not importable here (a script's __main__, a test module)
            answer = ("unknown", f"{type(exc).__name__}: {exc}")
        else:
            try:
                compile_here(dispatcher, types)
            except Exception as exc:  # reported to the rank, which keeps its interpreted path
                answer = ("failed", f"{type(exc).__name__}: {exc}")
        try:
            _send(replies, answer)
        except OSError:
            return


if __name__ == "__main__":
    from ferrodist.core._compile.helper import main as run  # the module's own copy, not __main__'s

    run(int(sys.argv[1]), int(sys.argv[2]))
