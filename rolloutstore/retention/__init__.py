"""What happens to rows after they are written: retention plans that keep diversity
(:mod:`.policy`), eviction (:mod:`.evict`, the only place rows leave a store) and re-scoring
under a new reward version (:mod:`.rescore`, token columns untouched)."""
