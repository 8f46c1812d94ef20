import sys

from mla_eval.cli import main

sys.exit(main())
