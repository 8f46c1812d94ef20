"""Training recipe for the embedded default model (`mla_eval/default_model/`).

`python -m tools.train prepare ...` builds the data shards and the tokenizer on a CPU machine;
`python -m tools.train train ...` trains (resumable) and evaluates on a GPU. The recipe file
`recipes/train-default-model.toml` holds every hyper-parameter; `results/default_model/` holds the
log and the commands that produced the shipped weights.
"""
