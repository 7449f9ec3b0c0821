"""tools/gpu_check.sh --cpu: the GPU check's own code path at tiny sizes (transformers backend).

The same script on a GPU runs vLLM in bf16; here it must finish a bf16 sync run, measure the
staleness-0 behaviour-vs-learner gap within its thresholds, and say PASS.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers import ROOT


def test_gpu_check_cpu_passes_and_reports_every_number(tmp_path):
    p = subprocess.run(
        [str(ROOT / "tools" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    for label in ("device", "dtype", "generated tokens/s", "learner tokens/s", "peak GPU memory"):
        assert re.search(rf"^{label}\s", out, re.M), out
    assert "dtype                bfloat16" in out
    gap = re.search(r"staleness-0 gap\s+max (\S+)\s+mean (\S+) nats", out)
    max_gap, mean_gap = float(gap.group(1)), float(gap.group(2))
    # Really bf16 (float32 on both sides would be ~1e-7), and within the bf16 bound.
    assert 0 < mean_gap < 0.01 and max_gap < 0.05, out
    assert float(re.search(r"generated tokens/s\s+(\S+)", out).group(1)) > 0
    assert out.rstrip().endswith("PASS")
