"""One rank of a 2-process kld run for tests/test_distributed.py (launched with RANK / WORLD_SIZE set, as
torchrun sets them). Rank 1 fails on purpose after scoring its windows, before the final gather:

    python tests/dist_fault_worker.py exit|raise|hang|none  kld ARGS...

exit: the process dies (os._exit, as when killed); raise: it raises and exits through the CLI;
hang: it stops answering (sleeps); none: no fault. Rank 0 always runs the command unchanged.
"""

import os
import sys
import time

from mla_eval.evals import kld_evaluation


def _faulty(real, mode):
    def run_kld(*args, **kwargs):
        result = real(*args, **kwargs)
        if mode == "exit":
            os._exit(3)
        if mode == "raise":
            raise RuntimeError("injected failure on rank 1")
        time.sleep(3600)
        return result

    return run_kld


if __name__ == "__main__":
    mode, argv = sys.argv[1], sys.argv[2:]
    if os.environ.get("RANK") == "1" and mode in ("exit", "raise", "hang"):
        kld_evaluation.run_kld = _faulty(kld_evaluation.run_kld, mode)
    from mla_eval.cli import main

    sys.exit(main(argv))
