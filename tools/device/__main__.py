"""python -m tools.device STEP [options] (the steps: tools/device/steps.py)."""

from __future__ import annotations

import sys

from tools.device.steps import parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.runner(args)


if __name__ == "__main__":
    sys.exit(main())
