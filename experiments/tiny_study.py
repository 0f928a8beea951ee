r"""The tiny reproduction: cold-start SFT + BiCuRL rounds, argmin (BaT) against uniform.

Both variants run `configs/tiny.py` with the same overrides (below) and differ only in
`curriculum.mode`, so they take the same GRPO steps on the same paired held-out cells. Results:
ROOT/<mode>/report.{json,md} + plots per run, ROOT/comparison.{md,json,png} across runs.

  python experiments/tiny_study.py --root=runs/tiny_study            # both runs, one at a time
  python experiments/tiny_study.py --root=runs/tiny_study --parallel=2
  python experiments/tiny_study.py --root=runs/tiny_study --collect_only

configs/tiny.py itself is sized for a 2-core CPU (an SFT step at [8, 1024] takes 7.5 s and at
[8, 2048] 27 s under load; experiments/perf/tiny_phases.py): SFT rows longer than 1,024 tokens are
dropped (what remains is the first action of each stage), rollouts and evaluation episodes get 3
turns of at most 256 tokens (every expert first action of S1, S3, S4, S5 fits in 256 tokens).
The study only turns the progress bars off, since two runs share one terminal.
"""


from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # noqa: E402

CPU_BUDGET = {"logging.progress": False}  # tiny.py already fits the CPU budget
MODES = ("argmin", "uniform")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--root", type=Path, required=True)
  parser.add_argument("--parallel", type=int, default=1)
  parser.add_argument("--collect_only", action="store_true")
  args = parser.parse_args()
  rows = sweep.run_sweep("curriculum_mode", args.root.absolute(), config="configs/tiny.py",
                         labels=MODES, extra=sweep.override_flags(CPU_BUDGET),
                         parallel=args.parallel, collect_only=args.collect_only)
  print(sweep.markdown("curriculum_mode", rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
