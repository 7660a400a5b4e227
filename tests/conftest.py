import sys
from pathlib import Path

# Worker functions live in tests/workers.py; spawned ranks import it by name.
sys.path.insert(0, str(Path(__file__).parent))
