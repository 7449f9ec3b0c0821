"""The append-only log: opening and atomic appends (:mod:`.log`), the dataset layout
(:mod:`.layout`), the usage/lineage/rewards side tables (:mod:`.side_tables`), compaction and
torn-manifest recovery (:mod:`.maintenance`), garbage collection (:mod:`.gc`), unique rollout
ids (:mod:`.unique`), schema migration (:mod:`.migrate`) and statistics (:mod:`.stats`)."""
