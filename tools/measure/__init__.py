"""GPU measurements of hardware arithmetic that the format specs and the codec reproduce (tables under
mla_eval/formats/data/). Run on a GPU machine: `python -m tools.measure.<name>`."""
