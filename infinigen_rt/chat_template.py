"""Rendering a bundle's chat template (Jinja, in the sandbox transformers uses) in a small child process.

A chat template is code that came with the bundle: in-process, `{{ 'a' * 400000000 }}` or nested loops take the
memory and time of the server that renders it, and jinja's sandbox bounds neither. So templates render in one child
process per process (chat_template_worker.py: the standard library and jinja2 only), started on first use and
reused, whose address space is capped (`MEMORY_HEADROOM` over its baseline) and whose every render has a deadline
(`RENDER_TIMEOUT_S`, wall clock, then CPU time as a backstop) and a length cap. A template that breaks any of these,
raises, or crashes the process is one InfinigenError naming it; the process is replaced when it was killed or ran
out of memory, and the caller goes on. A render costs well under a millisecond plus the pipe's round trip.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from infinigen_rt.errors import InfinigenError

RENDER_TIMEOUT_S = 5.0  # wall clock per render (a real template takes well under a millisecond)
START_TIMEOUT_S = 30.0  # for the process to start (python and jinja2 imported), not counted in a render's deadline
MEMORY_HEADROOM = 256 << 20  # address space the process may add to its baseline (its text, copies, JSON)
MAX_CHARS = 16 << 20  # the longest text a render may return, whatever the caller asks
WORKER = Path(__file__).with_name("chat_template_worker.py")

_HEADER = struct.Struct(">Q")
_FIX = "fix the template (tokenizer.chat_template in bundle.json) or use another bundle"


class _Timeout(Exception):
    pass


class _Gone(Exception):
    """The process closed its end of a pipe (it exited, or was killed)."""


def render(template: str, context: dict, max_chars: int = MAX_CHARS, timeout: float | None = None) -> str:
    """`template` rendered with `context` (JSON-able: messages, bos_token, ...) exactly as an in-process
    ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols) with `raise_exception` would; every
    failure (it raised, took longer than `timeout` s (default RENDER_TIMEOUT_S), needed more memory than allowed,
    wrote more than `max_chars` characters, or crashed the process) is an InfinigenError on one line."""
    return _RENDERER.render(template, context, min(max_chars, MAX_CHARS),
                            RENDER_TIMEOUT_S if timeout is None else timeout)  # fmt: skip


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _Renderer:
    """The render process of this process: started lazily, one render at a time (a lock: the server renders from
    several threads), replaced after a timeout, a crash or running out of memory, killed at exit."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.memory_limit: int | None = None
        atexit.register(self.close)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def render(self, template: str, context: dict, max_chars: int, timeout: float) -> str:
        request = {"template": template, "context": context, "max_chars": max_chars, "cpu_s": timeout}
        data = json.dumps(request, ensure_ascii=False).encode("utf-8", "surrogatepass")
        with self.lock:
            proc = self._running()
            deadline = time.monotonic() + timeout
            try:
                self._send(proc, data, deadline)
                reply = self._receive(proc, deadline)
            except _Timeout:
                self._stop()
                raise InfinigenError(
                    f"the bundle's chat template took longer than {timeout:g} s to render; {_FIX}"
                ) from None
            except (_Gone, OSError, ValueError):  # ValueError: a reply that is not JSON
                raise self._crashed() from None
            except BaseException:  # a KeyboardInterrupt mid-render: the reply would answer the next request
                self._stop()
                raise
            if reply.get("error") == "memory":
                limit = self.memory_limit
                self._stop()
        if "text" in reply:
            return reply["text"]
        kind, message = reply.get("error"), _one_line(str(reply.get("message", "")))
        if kind == "raise":  # the template's own refusal (roles out of order, ...): its message is for the user
            raise InfinigenError(f"chat template: {message}")
        if kind == "memory":
            need = f"more than {MEMORY_HEADROOM >> 20} MiB" if limit is not None else "more memory than there is"
            raise InfinigenError(f"the bundle's chat template needed {need} to render; {_FIX}")
        if kind == "too_long":
            raise InfinigenError(f"the bundle's chat template rendered more than {max_chars:,} characters, more than "
                                 f"any prompt the model can take; {_FIX}")  # fmt: skip
        raise InfinigenError(f"the bundle's chat template failed to render: {message}; {_FIX}")

    def _running(self) -> subprocess.Popen:
        """The render process, started (and its ready message read) if there is none or it has exited."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self._stop()
        try:
            # stderr to /dev/null: a dying process's noise would break the CLIs' one-line errors
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), str(MEMORY_HEADROOM)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
            )  # fmt: skip
            for f in (self.proc.stdin, self.proc.stdout):
                os.set_blocking(f.fileno(), False)  # every read and write waits with a deadline (selectors)
            ready = self._receive(self.proc, time.monotonic() + START_TIMEOUT_S)
        except (OSError, _Timeout, _Gone, ValueError) as e:
            self._stop()
            why = f": {_one_line(str(e))}" if isinstance(e, OSError) else ""
            raise InfinigenError(
                f"the process that renders chat templates did not start ({sys.executable} {WORKER.name}{why}); "
                "check that jinja2 is installed for this Python"
            ) from None
        self.memory_limit = ready.get("memory_limit")
        return self.proc

    def _send(self, proc: subprocess.Popen, data: bytes, deadline: float) -> None:
        view = memoryview(_HEADER.pack(len(data)) + data)
        fd = proc.stdin.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while view:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise _Timeout()
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    raise _Gone() from None

    def _receive(self, proc: subprocess.Popen, deadline: float) -> dict:
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)

            def read(n: int) -> bytes:
                buf = bytearray()
                while len(buf) < n:
                    if not sel.select(max(0.0, deadline - time.monotonic())):
                        raise _Timeout()
                    try:
                        chunk = os.read(fd, min(n - len(buf), 1 << 20))
                    except BlockingIOError:
                        continue
                    if not chunk:
                        raise _Gone()
                    buf += chunk
                return bytes(buf)

            (n,) = _HEADER.unpack(read(_HEADER.size))
            return json.loads(read(n))

    def _crashed(self) -> InfinigenError:
        """The process died mid-render: said by how it ended (the CPU limit is the deadline's backstop)."""
        proc = self.proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        self._stop()
        if code is not None and code < 0 and -code == getattr(signal, "SIGXCPU", None):
            return InfinigenError(f"the bundle's chat template ran past its CPU time limit; {_FIX}")
        how = "was killed" if code is None else _exit_text(code)
        return InfinigenError(f"the bundle's chat template crashed the process rendering it (it {how}); {_FIX}")

    def _stop(self) -> None:
        """Kill the process (if any) and reap it: no zombie is left behind."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        """At exit: the process goes with its parent (it would also exit at the end of its stdin)."""
        self._stop()

    def _forget(self) -> None:
        """In a forked child: the parent's process and lock are the parent's; this child starts its own. The
        inherited pipe ends are closed, so the parent's process still sees its stdin end when the parent exits."""
        self.lock = threading.Lock()
        proc, self.proc = self.proc, None
        if proc is not None:
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            proc.returncode = 0  # not this child's to wait for (Popen's finalizer must not reap it)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"ended by {signal.Signals(-code).name}"
        except ValueError:
            return f"ended by signal {-code}"
    return f"exited with status {code}"


_RENDERER = _Renderer()
