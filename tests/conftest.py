import sys
from pathlib import Path

# test helpers (k3fixtures, refutil) live beside the tests
sys.path.insert(0, str(Path(__file__).resolve().parent))
