"""The trainer tests share the tiny policies and batches of tests/grpo."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "grpo"))
