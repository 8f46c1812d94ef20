"""mla-eval: quality and capacity evaluation of low-precision MLA KV caches."""

__version__ = "0.1.0"
