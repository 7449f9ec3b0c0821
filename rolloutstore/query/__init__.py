"""DuckDB over the store: a locked-down connection with the store's views and parameterized
queries (:mod:`.sql`), and the limits every query runs under (:mod:`.limits`: time, memory,
threads, Ctrl-C)."""
