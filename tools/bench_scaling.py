"""The numbers that decide scale-out (docs/scaling.md), measured side by side in one run.

    python tools/bench_scaling.py                        # ~2-4 minutes on 2 cores
    python tools/bench_scaling.py --quick --json scaling.json

1. Store bytes per million rollouts at ~1k and ~32k tokens per rollout (proxy data as
   tools/bench_store.py: Zipf ids, log-prob mixture, lognormal lengths; local folder).
2. Object-store requests per training step: a real S3-compatible server (moto, in this
   process) behind a counting WSGI layer; requests of one actor append, one selection
   (with its usage record), one loader step, one weight publish and one actor poll,
   on a store of F fragments, for two F.
3. Commit rate to one Lance dataset: P processes appending small batches concurrently,
   local folder and moto S3; commits/s and the conditional-put conflicts (HTTP 412)
   that Lance retried.
4. Learner demand: tokens/s a 7B model trains on one H200 from FLOPs (6 N per token,
   989 TFLOP/s bf16 dense, MFU assumed 40%, --mfu), against the loader's measured rate.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolloutstore import ReplayConfig, ReplayDataset, RolloutStore  # noqa: E402
from rolloutstore.io.proxy import proxy_batches  # noqa: E402
from rolloutstore.replay.selector import Selector  # noqa: E402

H200_BF16_DENSE = 989e12  # FLOP/s, NVIDIA H200 SXM datasheet (dense, no sparsity)


# -- a counting S3 server ----------------------------------------------------------------------
def _kind(path: str, query: str) -> str:
    if "list-type" in query:
        return "LIST"
    for key, name in (
        ("/_versions/", "manifest"),
        ("/_transactions/", "txn"),
        ("/data/", "data"),
        ("/_deletions/", "deletion"),
        ("/_indices/", "index"),
    ):
        if key in path:
            return name
    return path.rsplit("/", 1)[-1] if "/weights/" in path or "LATEST" in path else "other"


class CountingS3:
    """moto's S3 in a thread, every request counted by (method, object kind, status)."""

    def __init__(self):
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        inner = DomainDispatcherApplication(create_backend_app)

        def app(environ, start_response):
            key = [environ["REQUEST_METHOD"], _kind(environ["PATH_INFO"], environ["QUERY_STRING"])]

            def start(status, headers, *exc):
                with self._lock:
                    self.counts[(*key, status.split()[0])] += 1
                return start_response(status, headers, *exc)

            return inner(environ, start)

        self._srv = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._srv.server_address[1]}"

    def bucket(self, name: str) -> tuple[str, dict[str, str]]:
        import pyarrow.fs as pafs

        pafs.S3FileSystem(
            access_key="bench",
            secret_key="bench",
            endpoint_override=self.endpoint,
            region="us-east-1",
            allow_bucket_creation=True,
        ).create_dir(name)
        return f"s3://{name}", {
            "aws_access_key_id": "bench",
            "aws_secret_access_key": "bench",
            "aws_endpoint": self.endpoint,
            "aws_region": "us-east-1",
            "allow_http": "true",
        }

    def measure(self, fn) -> collections.Counter:
        with self._lock:
            before = self.counts.copy()
        fn()
        with self._lock:
            return self.counts - before


def _fmt(c: collections.Counter) -> str:
    by = collections.Counter()
    for (method, kind, _status), n in c.items():
        by[f"{method} {kind}"] += n
    return ", ".join(f"{k} {n}" for k, n in sorted(by.items(), key=lambda kv: -kv[1]))


# -- 1. bytes per million rollouts ------------------------------------------------------------
def bytes_per_million(quick: bool) -> list[dict]:
    out = []
    # (label, rollouts, mean completion tokens, prompt token range, max completion tokens)
    cases = [
        ("~1k tokens", 1000 if quick else 4000, 800, (64, 256), 8192),
        ("~32k tokens", 40 if quick else 160, 31500, (256, 768), 131072),
    ]
    for label, n, mean_c, prompt, max_c in cases:
        with tempfile.TemporaryDirectory() as d:
            store = RolloutStore.open(Path(d) / "store")
            for t in proxy_batches(
                n,
                seed=0,
                mean_completion_tokens=mean_c,
                prompt_tokens=prompt,
                max_completion_tokens=max_c,
                batch_rollouts=max(8, min(1024, 2_000_000 // mean_c) // 8 * 8),
            ):
                store.append(t)
            st = store.stats()
            per_rollout = st["bytes_on_disk"] / st["rows"]
            out.append(
                {
                    "case": label,
                    "rollouts": st["rows"],
                    "tokens_per_rollout": st["tokens"] / st["rows"],
                    "bytes_per_token": st["bytes_per_token"],
                    "bytes_per_rollout": per_rollout,
                    "tb_per_million_rollouts": per_rollout * 1e6 / 1e12,
                }
            )
    return out


# -- 2. requests per training step --------------------------------------------------------------
def requests_per_step(s3: CountingS3, fragments: list[int]) -> list[dict]:
    out = []
    for frags in fragments:
        out += _requests_at(s3, frags)
    return out


def _requests_at(s3: CountingS3, frags: int) -> list[dict]:
    import torch

    from trainer.rollout.weights import latest_weights, publish_weights

    out = []
    uri, opts = s3.bucket(f"req-{frags}")
    store = RolloutStore.open(f"{uri}/store", embedding_dim=8, storage_options=opts)
    for b in range(frags):  # one actor append = one fragment
        store.append(
            proxy_batches(
                256,
                seed=b,
                start_index=256 * b,
                rollouts_per_version=512,
                mean_completion_tokens=64,
                prompt_tokens=(16, 32),
                embedding_dim=8,
                batch_rollouts=256,
            )
        )
    cfg = ReplayConfig(window=4096, seed=0)
    v = store.sql("SELECT max(policy_version) AS v FROM rollouts")["v"][0].as_py()
    sel = Selector(store, cfg, run_id="bench")
    sel.sample(256, v + 1)  # warm: per-fragment stats cached, as in a running learner

    actor = RolloutStore.open(f"{uri}/store", storage_options=opts)
    batch = list(proxy_batches(256, seed=999, start_index=10**6, embedding_dim=8,
                               mean_completion_tokens=64, prompt_tokens=(16, 32),
                               batch_rollouts=256))  # fmt: skip
    rows = {
        "append (256 rollouts)": s3.measure(lambda: actor.append(batch)),
        "selection (256, with usage record)": s3.measure(lambda: sel.sample(256, v + 1)),
    }
    loader = ReplayDataset(store, cfg, batch_size=256, learner_version=v + 1, steps=1,
                           run_id="bench-loader", prefetch=0)  # fmt: skip
    rows["loader step (selection + tokens)"] = s3.measure(lambda: list(loader))
    model = torch.nn.Linear(256, 256)
    rows["publish weights (256 KB)"] = s3.measure(
        lambda: publish_weights(f"{uri}/weights", 1, model, storage_options=opts)
    )
    rows["actor poll of LATEST"] = s3.measure(lambda: latest_weights(f"{uri}/weights", opts))
    for name, c in rows.items():
        out.append(
            {
                "fragments": frags,
                "operation": name,
                "requests": sum(c.values()),
                "detail": _fmt(c),
            }
        )
    return out


# -- 3. commit rate ---------------------------------------------------------------------------
def _appender(uri: str, opts: dict | None, k: int, n: int, q) -> None:
    store = RolloutStore.open(uri, storage_options=opts)
    rows = [
        {"prompt_ids": [k, i], "completion_ids": [1, 2, 3], "behavior_logprobs": [-0.1] * 3,
         "policy_version": 0}
        for i in range(16)
    ]  # fmt: skip
    t0 = time.perf_counter()
    for _ in range(n):
        store.append(rows)
    q.put(time.perf_counter() - t0)


def commit_rate(s3: CountingS3, procs: list[int], commits: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = []
    with tempfile.TemporaryDirectory() as d:
        for where in ("local", "s3"):
            for p in procs:
                if where == "local":
                    uri, opts = str(Path(d) / f"c{p}"), None
                else:
                    root, opts = s3.bucket(f"commit-{p}")
                    uri = f"{root}/store"
                RolloutStore.open(uri, storage_options=opts)
                q = ctx.Queue()
                before = s3.counts.copy()
                t0 = time.perf_counter()
                workers = [
                    ctx.Process(target=_appender, args=(uri, opts, k, commits, q)) for k in range(p)
                ]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
                wall = time.perf_counter() - t0
                busy = max(q.get() for _ in workers)
                delta = s3.counts - before
                conflicts = sum(n for (m, kind, st), n in delta.items() if st == "412")
                store = RolloutStore.open(uri, storage_options=opts)
                assert store.count() == p * commits * 16, "lost or duplicated rows"
                out.append(
                    {
                        "where": where,
                        "processes": p,
                        "commits": p * commits,
                        "commits_per_s": p * commits / busy,
                        "wall_s": wall,
                        "conflicts_412": conflicts,
                    }
                )
    return out


# -- 4. learner demand ------------------------------------------------------------------------
def learner_demand(params: float, mfu: float) -> dict:
    flops_per_token = 6 * params
    tokens_per_s = H200_BF16_DENSE * mfu / flops_per_token
    return {"params": params, "mfu": mfu, "train_tokens_per_s_per_h200": tokens_per_s}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rollouts and commits")
    ap.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res: dict = {}
    t0 = time.time()

    res["bytes"] = bytes_per_million(a.quick)
    print("\n## Store bytes per million rollouts (local folder, proxy data)")
    print("| case | rollouts | tokens/rollout | bytes/token | bytes/rollout | TB per 1M rollouts |")
    print("|---|---|---|---|---|---|")
    for r in res["bytes"]:
        print(f"| {r['case']} | {r['rollouts']} | {r['tokens_per_rollout']:,.0f} | "
              f"{r['bytes_per_token']:.2f} | {r['bytes_per_rollout']:,.0f} | "
              f"{r['tb_per_million_rollouts']:.3f} |")  # fmt: skip

    s3 = CountingS3()
    res["requests"] = requests_per_step(s3, [8, 32] if not a.quick else [4, 16])
    print("\n## Object-store requests per operation (moto S3, counted at the server)")
    print("| fragments | operation | requests | by kind |")
    print("|---|---|---|---|")
    for r in res["requests"]:
        print(f"| {r['fragments']} | {r['operation']} | {r['requests']} | {r['detail']} |")

    res["commits"] = commit_rate(s3, [1, 4], 10 if a.quick else 25)
    print("\n## Commit rate to one Lance dataset (16-row appends)")
    print("| store | processes | commits | commits/s | conflicts retried (412) |")
    print("|---|---|---|---|---|")
    for r in res["commits"]:
        print(f"| {r['where']} | {r['processes']} | {r['commits']} | "
              f"{r['commits_per_s']:.1f} | {r['conflicts_412']} |")  # fmt: skip

    res["learner"] = learner_demand(7e9, a.mfu)
    tps = res["learner"]["train_tokens_per_s_per_h200"]
    print(f"\n## Learner demand: 7B on one H200 at MFU {a.mfu:.0%}: {tps:,.0f} train tokens/s "
          f"(6 x 7e9 FLOP/token, {H200_BF16_DENSE / 1e12:.0f} TFLOP/s bf16 dense); "
          f"8 learners: {8 * tps:,.0f} tokens/s")  # fmt: skip
    print(f"\n({time.time() - t0:.0f} s, {os.cpu_count()} cores)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
