"""What a plan process imports: a plan decodes nothing and trains nothing for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def test_a_plan_imports_transformers_nowhere_and_torch_only_where_it_batches(tmp_path):
    """Each cost 1.3-3 s a process, most of a small plan's wall time. The agent loops read only the
    tokenizer's special ids; the process that spreads a plan over workers never trains or batches
    (configs/plan.yaml, one step): torch comes in with the first rollout batch, in a run."""
    code = (
        "import sys\n"
        "from rollfleet.config import load_config\n"
        "from rollfleet.plan.planner import PlanSpec, run_plan\n"
        "cfg = load_config('configs/plan.yaml', {'trainer.total_steps': 1})\n"
        "spec = PlanSpec(cfg, gpus=4, modes=('sync',), seeds=(0,), warmup_steps=0, output_dir=sys.argv[1])\n"
        "print('torch' in sys.modules)\n"
        "run_plan(spec, workers=1)\n"
        "print('transformers' in sys.modules, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["False", "False True"]
