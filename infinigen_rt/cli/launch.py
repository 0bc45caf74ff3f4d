"""`--tp N` outside torchrun: the command line run again as N ranks under torchrun on this machine (the CLI's own
layer: it reads the bundle, and prints the ranks' errors once)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from infinigen_rt.bundle import read_bundle
from infinigen_rt.cli.console import RANK_ERRORS_ENV, print_error
from infinigen_rt.hub import resolve_bundle
from infinigen_rt.tp import check_size


def strip_tp(argv: list[str]) -> list[str]:
    """The command line without its `--tp N` (or `--tp=N`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--tp":
            skip = True
        elif not a.startswith("--tp="):
            out.append(a)
    return out


# torchrun, less its own noise: a rank that fails has printed its one-line error already, so torchrun's error log,
# its ChildFailedError traceback and summary go; the exit code is the first failed rank's (128 + N for signal N)
_TORCHRUN = """
import logging, sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run
logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
try:
    run(parse_args(sys.argv[1:]))
except ChildFailedError as e:
    code = e.get_first_failure()[1].exitcode
    sys.exit(code if code > 0 else 128 - code if code < 0 else 1)
except SignalException as e:
    sys.exit(128 + int(e.sigval))
"""


def launch(n: int, argv: list[str], bundle: str, revision: str | None = None) -> int:
    """`--tp N` outside torchrun: run this command line (less --tp) as N ranks under torchrun on this machine; the
    exit code of the group. `bundle` (the command's argument) is read first: a size that does not split its heads,
    or a bundle that is not there, is one line here rather than one per rank and torchrun's traceback."""
    check_size(read_bundle(resolve_bundle(bundle, revision), verify=False).config, n)

    cmd = [sys.executable, "-c", _TORCHRUN, "--standalone", "--nproc-per-node", str(n),
           "-m", "infinigen_rt.cli", *strip_tp(argv)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="infinigen-tp-") as tmp:
        errors = Path(tmp) / "errors"
        # OMP_NUM_THREADS=1 is what torchrun sets for each rank anyway, with a banner when it was unset
        env = {"OMP_NUM_THREADS": "1", **os.environ, RANK_ERRORS_ENV: str(errors)}
        proc = subprocess.Popen(cmd, env=env)
        # a signal to this process (a service manager's SIGTERM) goes on to torchrun, which ends every rank
        forward = {s: signal.signal(s, lambda sig, _: proc.send_signal(sig)) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = proc.wait()
        finally:
            for s, old in forward.items():
                signal.signal(s, old)
        # the ranks run the same checks: the same error from each is said once
        lines = errors.read_text(encoding="utf-8").splitlines() if errors.exists() else []
        for line in dict.fromkeys(lines):
            print_error(line)
    return code
