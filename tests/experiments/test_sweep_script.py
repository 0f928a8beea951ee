"""experiments/sweep.py: every run validated before any starts, streamed progress, resume, a
non-zero exit when a run fails, mean ± SE over seeds and one plot panel per stage.

The runs are a stand-in launcher with launch.py's flags (a real run is minutes); it writes what a
finished run writes (config.json, report.json) or fails like a crashed one."""

import json
import pathlib
import sys
import textwrap

import pytest

from bat_jax import workflow

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "experiments"))
import sweep  # noqa: E402

FAKE_LAUNCH = textwrap.dedent('''
    import json, os, pathlib, sys
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    work = pathlib.Path(args["workdir"])
    with open(os.environ["SWEEP_CALLS"], "a") as f:
      f.write(work.parent.name + "/" + work.name + "\\n")
    if args.get("config.grpo.lr") == os.environ.get("SWEEP_FAIL_LR"):
      print("Traceback ...\\nRuntimeError: boom"); sys.exit(1)
    seed, lr = int(args["config.seed"]), float(args.get("config.grpo.lr", 0))
    work.mkdir(parents=True, exist_ok=True)
    score = lambda i: round(0.2 + 0.1 * i + 100 * lr + 0.01 * seed, 4)
    evals = [{"policy": p, "overall": score(i), "stage_scores": {s: score(i) for s in
              ("S1", "S2", "S3", "S4", "S5")}} for i, p in enumerate(("sft", "round_000000"))]
    rounds = [{"grpo_steps": 2, "reward_mean": 0.1, "target": "S1", "weights": {
        "stage_weights": {s: 0.2 for s in ("S1", "S2", "S3", "S4", "S5")},
        "pool_mix": {"s_target": 0.5, "s_mix": 0.25, "e2e": 0.25}}}]
    (work / "config.json").write_text(json.dumps({"grpo": {"rounds": 1}}))
    (work / "report.json").write_text(json.dumps({"evaluations": evals, "rounds": rounds,
                                                  "finished_rounds": 1}))
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
  launch = tmp_path / "fake_launch.py"
  launch.write_text(FAKE_LAUNCH)
  calls = tmp_path / "calls.txt"
  monkeypatch.setenv("SWEEP_CALLS", str(calls))
  return launch, calls


def _sweep(root, launch, *extra, grid=("grpo.lr=1e-4,3e-4",), seeds="0,1"):
  argv = [f"--root={root}", f"--seeds={seeds}", f"--launch={launch}"]
  for g in grid:
    argv += ["--grid", g]
  return sweep.main(argv + list(extra))


def test_a_failing_run_exits_non_zero_and_resume_reruns_only_it(tmp_path, fake, capsys,
                                                                  monkeypatch):
  launch, calls = fake
  root = tmp_path / "sweep"
  monkeypatch.setenv("SWEEP_FAIL_LR", "3e-4")
  assert _sweep(root, launch, "--", "--config.grpo.rounds=1") == 1
  out, err = capsys.readouterr()
  progress = [l for l in out.splitlines() if l.startswith("[")]
  assert len(progress) == 4 and [l[:5] for l in progress] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
  assert sum("FAILED   grpo.lr=3e-4 seed" in l for l in progress) == 2
  assert any(l.endswith("RuntimeError: boom") for l in progress)  # the log's last line
  assert "2 of 4 run(s) failed" in err
  md = (root / "sweep.md").read_text()
  assert "| grpo.lr=1e-4 | 2 | round_000000 | 2 | 0.315 ± 0.005 |" in md
  assert "grpo.lr=3e-4 |" not in md

  monkeypatch.setenv("SWEEP_FAIL_LR", "none")
  first = calls.read_text().splitlines()
  assert _sweep(root, launch, "--", "--config.grpo.rounds=1") == 0
  rerun = calls.read_text().splitlines()[len(first):]
  assert sorted(rerun) == ["grpo.lr=3e-4/seed_0", "grpo.lr=3e-4/seed_1"]
  out = capsys.readouterr().out
  assert out.count("skipped  grpo.lr=1e-4 seed") == 2
  md = (root / "sweep.md").read_text()
  assert "| grpo.lr=3e-4 | 2 | round_000000 | 2 | 0.335 ± 0.005 |" in md
  assert (root / "sweep.png").is_file() and json.loads((root / "sweep.json").read_text())


@pytest.mark.parametrize("args, message", [
    (["--", "--config.grpo.lrr=1e-6"], "--config.grpo.lrr=1e-6: no config field 'lrr'"),
    (["--grid", "sft.steps=10,0"], "grpo.lr=1e-4,sft.steps=0 seed 0: config.sft.steps: must be > 0"),
    (["--grid", "curriculum.modee=uniform"], "no config field 'modee'"),
])
def test_every_run_is_validated_before_any_starts(tmp_path, fake, capsys, args, message):
  launch, calls = fake
  assert _sweep(tmp_path / "sweep", launch, *args, grid=("grpo.lr=1e-4,3e-4",)) == 2
  err = capsys.readouterr().err
  assert "nothing started" in err and message in err
  assert not calls.exists() and not (tmp_path / "sweep").exists()


def test_grid_is_a_product_of_any_fields():
  grid = sweep.parse_grid(["grpo.lr=1e-4,3e-4", "curriculum.mode=argmin,uniform",
                           "sft.bucket_lengths=(64, 128),(256,)"])
  variants = sweep.grid_variants(grid)
  assert len(variants) == 8
  assert variants[0] == ("grpo.lr=1e-4,curriculum.mode=argmin,sft.bucket_lengths=(64, 128)",
                         {"grpo.lr": "1e-4", "curriculum.mode": "argmin",
                          "sft.bucket_lengths": "(64, 128)"})
  with pytest.raises(ValueError, match="expected FIELD=V1,V2"):
    sweep.parse_grid(["grpo.lr"])


def test_plot_has_one_panel_per_stage_and_integer_round_ticks():
  def report(x):
    return {"evaluations": [{"policy": p, "overall": x + i / 10,
                             "stage_scores": {s: x for s in workflow.STAGES}}
                            for i, p in enumerate(("sft", "round_000000", "round_000001"))]}
  fig = sweep.stages_figure({"a": {0: report(0.1), 1: report(0.2)}, "b": {0: report(0.3)}}, "t")
  axes = fig.axes
  assert [a.get_title() for a in axes] == ["overall", *workflow.STAGES]
  assert list(axes[0].get_xticks()) == [0, 1, 2]
  assert [t.get_text() for t in axes[0].get_xticklabels()] == ["sft", "r1", "r2"]
  assert len(axes[0].get_legend().get_texts()) == 2
