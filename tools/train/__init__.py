"""Training recipe for the embedded default model (`mla_eval/default_model/`).

`python -m tools.train prepare ...` builds the data shards and the tokenizer on a CPU machine;
`python -m tools.train train ...` trains (resumable) and evaluates on a GPU. The recipe file
`recipes/train-default-model.toml` holds every hyper-parameter; docs/findings/2026-12-02-default-model-pretraining.md and
docs/findings/2026-12-04-default-model-task-curricula.md hold the commands that produced the shipped weights. On a
GPU machine `python -m tools.device train-tok`, `train`, `train-check` run them.
"""
