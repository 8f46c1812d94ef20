"""The version of mla-eval: its one definition (pyproject.toml reads it; results record it)."""

__version__ = "0.1.0"
