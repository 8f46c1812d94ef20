"""mla-eval's CuTe DSL kernels for Hopper (sm_90a): the MLA cache writer and absorbed MLA attention over the
paged, quantised latent cache, one record layout per cache format.

Two parts, imported in one direction:
- `mla_eval_kernels.plan`: pure Python (no cutlass; torch only to read device limits). What a format's record
  means to a kernel (`record_plan`), which kernel and tile a launch runs (`tuning`), the launch grid and split-KV
  schedule (`launch_grid`, `launch`), bit models of the E2M1 decode (`e2m1_bits`). The dispatcher and CPU tests
  import it.
- `mla_eval_kernels.cute`: the CuTe DSL kernels and their host launcher. Imported only when a kernel runs.

Kernels import `mla_eval.formats` (the spec a record plan is derived from) and their own plan, nothing else of
mla_eval: the dispatcher (`mla_eval.attention.dispatch`) imports the kernels, never the reverse. The contract is
in pyproject.toml (`[tool.importlinter]`) and runs in CI.
"""
