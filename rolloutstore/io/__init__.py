"""Rows in and out: ingest of rollout files (:mod:`.ingest`), other frameworks' text rollouts
(:mod:`.interop`), export to Parquet / JSONL / HF datasets in rollout, SFT, DPO or chat shape
(:mod:`.export`, :mod:`.shapes`, :mod:`.messages`), and proxy data for benchmarks
(:mod:`.proxy`)."""
