import sys
from pathlib import Path

# tests import their helpers (tiny_models) by plain name
sys.path.insert(0, str(Path(__file__).parent))
