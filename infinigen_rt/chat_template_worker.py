"""The process that renders chat templates (chat_template.py starts it as `python THIS_FILE HEADROOM_BYTES`).

It imports only the standard library and jinja2, never torch or the infinigen_rt package, so it starts in a tenth
of a second and a few tens of MB. It caps its own address space (HEADROOM_BYTES over what it holds once started)
and, per render, its CPU time, then answers requests on stdin with replies on stdout, each message an 8-byte
big-endian length and that many bytes of UTF-8 JSON:

- first, unasked: {"ready": true, "memory_limit": bytes or null}
- request: {"template": str, "context": {...}, "max_chars": int, "cpu_s": float}
- reply: {"text": str}, or {"error": KIND, "message": str} with KIND "raise" (the template called
  raise_exception), "failed" (rendering raised), "too_long" (more than max_chars), "memory" (after which this
  process exits: a fresh one is started for the next render).

It exits when stdin closes (its parent is gone), and the CPU limit ends a render its parent stopped waiting for.
"""

import os
import sys

# `python THIS_FILE` puts this file's folder (the infinigen_rt package) first on sys.path: drop it, so no module of
# the package can shadow one this process imports
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import json  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402

try:
    import resource
except ImportError:  # not a POSIX system: no limits, the parent's deadline still holds
    resource = None

import jinja2  # noqa: E402, F401  (imported before the limits: its import is not the template's cost)
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

HEADER = struct.Struct(">Q")
MAX_MESSAGE_CHARS = 500  # of an error's text sent back (the parent shows it on one line)
CACHED_TEMPLATES = 8  # compiled templates kept (a server renders one template again and again)


class TemplateRaised(Exception):
    """The template called raise_exception(message)."""


class TooLong(Exception):
    """The rendered text passed the request's max_chars."""


def raise_exception(message):
    raise TemplateRaised(str(message))


def make_env():
    """The sandbox transformers renders chat templates in (the same options and the raise_exception global)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env


def limit_memory(headroom):
    """Cap the address space at what this process maps now plus `headroom` bytes; the cap, or None."""
    if resource is None:
        return None
    try:
        with open("/proc/self/statm") as f:
            base = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        base = 1 << 30  # no /proc (macOS, which does not enforce RLIMIT_AS anyway): a generous base
    limit = base + headroom
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU dumps core by default: no core files
    except (ValueError, OSError):
        return None
    return limit


def limit_cpu(seconds):
    """Let this process use `seconds` more CPU time (then SIGXCPU ends it): a render its parent gave up on (the
    parent killed, or stuck) cannot spin on. The limit is cumulative, so it is moved up before each render."""
    if resource is None:
        return
    try:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        want = int(usage.ru_utime + usage.ru_stime + seconds) + 1
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (want, hard))
    except (ValueError, OSError):
        pass


def read_exact(f, n):
    data = f.read(n)
    return data if data is not None and len(data) == n else None


def read_message(f):
    """The next request, or None at the end of stdin."""
    head = read_exact(f, HEADER.size)
    if head is None:
        return None
    body = read_exact(f, HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


def encode(obj):
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


def write_message(f, data):
    f.write(HEADER.pack(len(data)))
    f.write(data)
    f.flush()


def render(env, cache, request):
    """The template rendered with the request's context, as Template.render would; pieces are counted as they
    come, so a template that writes without end stops at max_chars, not at the memory limit."""
    source = request["template"]
    template = cache.pop(source, None) or env.from_string(source)
    cache[source] = template  # the most recent last
    while len(cache) > CACHED_TEMPLATES:
        del cache[next(iter(cache))]
    limit, n = request["max_chars"], 0
    chunks, pending = [], []
    for piece in template.generate(**request["context"]):
        n += len(piece)
        if n > limit:
            raise TooLong()
        pending.append(piece)
        if len(pending) >= 4096:  # a template writing a character at a time: joined as it goes
            chunks.append("".join(pending))
            pending.clear()
    chunks.append("".join(pending))
    return "".join(chunks)


def error(kind, e):
    text = " ".join(f"{type(e).__name__}: {e}".split())
    if kind == "raise":
        text = " ".join(str(e).split())
    return {"error": kind, "message": text[:MAX_MESSAGE_CHARS]}


def main():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the parent's to handle
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the reply pipe
    env, cache = make_env(), {}
    write_message(out, encode({"ready": True, "memory_limit": limit_memory(int(sys.argv[1]))}))
    while True:
        request = read_message(inp)
        if request is None:
            return
        limit_cpu(float(request.get("cpu_s", 5.0)))
        data = None
        try:
            data = encode({"text": render(env, cache, request)})
        except TemplateRaised as e:
            data = encode(error("raise", e))
        except TooLong:
            data = encode({"error": "too_long", "message": ""})
        except MemoryError:
            pass
        except Exception as e:  # noqa: BLE001  (whatever the template did, the parent gets it as one line)
            data = encode(error("failed", e))
        if data is None:  # answered outside the handler: the traceback and what it held are gone
            cache.clear()
            write_message(out, encode({"error": "memory", "message": ""}))
            return  # a process that ran out of memory may be in any state: the parent starts a fresh one
        write_message(out, data)


if __name__ == "__main__":
    try:
        main()
    except (BrokenPipeError, KeyboardInterrupt):  # the parent went away mid-reply
        pass
