"""A child process that runs `mla_eval.cli.main` on argument lists sent to it, one JSON line each way, under an
address-space limit: tests/test_bad_paths.py feeds it device files and pipes, and a regression that reads
/dev/zero to the end, or waits on a FIFO, must cost this process (killed by the test's timeout, or a
MemoryError here) and never the machine.

Request: {"argv": [...], "cwd": "..."}. Reply: {"code": int, "out": str, "err": str}; an exception that
escaped `main` is a reply with code -1 and the traceback in err.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import sys
import traceback

HEADROOM = 3 << 30  # address space beyond what the imports took: a tiny model run fits, reading /dev/zero does not


def _vm_size() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    from mla_eval.cli import current_app
    from mla_eval.cli import main as cli_main

    current_app()
    import transformers  # noqa: F401  (imported before the limit: its import alone maps a lot)

    limit = _vm_size() + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        req = json.loads(line)
        os.chdir(req["cwd"])
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main(req["argv"])
        except BaseException:  # what main let escape: the test reports it as a traceback
            code = -1
            err.write(traceback.format_exc())
        replies.write(json.dumps({"code": code, "out": out.getvalue()[-4000:], "err": err.getvalue()[-4000:]}) + "\n")


if __name__ == "__main__":
    main()
