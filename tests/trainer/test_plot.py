from __future__ import annotations

import json

from trainer.run.plot import load_metrics, plot_run


def test_plots_every_series_from_metrics(tmp_path):
    recs = [{"kind": "eval", "step": 0, "reward": 0.2, "generated_tokens": 0}]
    for s in range(1, 11):
        recs.append(
            {
                "kind": "train",
                "step": s,
                "reward": s / 10,
                "entropy": 1 / s,
                "staleness": s % 3,
                "generated_tokens": 100 * s,
            }
        )
    recs.append({"kind": "eval", "step": 10, "reward": 0.7, "generated_tokens": 1000})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert len(load_metrics(tmp_path)["train"]) == 10
    paths = plot_run(tmp_path)
    assert sorted(p.name for p in paths) == ["entropy.png", "reward.png", "staleness.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
