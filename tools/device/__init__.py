"""The device campaigns: `python -m tools.device STEP [options]` on a lent GPU machine, after `tools/device/bootstrap.sh`
installed CuTe DSL there (`python -m tools.device --help` lists the steps; docs/CONTRIBUTING.md says how to run them).

Pass / fail checks are pytest tests (markers `gpu`, `multigpu`, `slow`; the step `tests` runs them); the steps here
are the campaigns that produce artefacts -- benchmarks, profiles, long-context grids, training, the GPU smoke and its
stamp -- each writing its logs and JSON under $OUT/runs/<step>/ (packed by the bootstrap into one archive, since a
device call returns at most 8 files). Every step runs each of its commands under a time limit, so a machine taken
back mid-call loses one command, and a rerun names only what is missing.
"""
