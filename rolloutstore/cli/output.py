"""What the CLI prints and writes: terminal tables (control characters escaped), CSV, JSON,
Parquet, and ``--out`` files written through a temporary file, or in place into a device or
FIFO (never into a store; :mod:`rolloutstore.io.outputs`)."""

from __future__ import annotations

import json
import sys

import pyarrow as pa

from rolloutstore.errors import UsageError


def escape_controls(s: str) -> str:
    """``s`` with control characters (C0, DEL, C1, and bidi/format controls) shown as escapes,
    so stored text cannot move the cursor, recolour or retitle the terminal."""
    if s.isprintable():
        return s
    out = []
    for ch in s:
        if ch.isprintable() or ch == " ":
            out.append(ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        else:
            o = ord(ch)
            out.append(
                f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"
            )
    return "".join(out)


def _cell(v, escape: bool = True) -> str:
    if isinstance(v, list):
        head = ", ".join(_cell(x, escape) for x in v[:4])
        return f"[{head}{', ...' if len(v) > 4 else ''}] ({len(v)})" if len(v) > 4 else f"[{head}]"
    if isinstance(v, float):
        return f"{v:.6g}"
    s = "NULL" if v is None else str(v)
    if escape:
        s = escape_controls(s)
    return s if len(s) <= 48 else s[:45] + "..."


def format_table(table: pa.Table, max_rows: int = 50, *, escape: bool = True) -> str:
    """A plain-text grid of the first ``max_rows`` rows; ``escape``: control characters
    (in cells and column names) as escapes, for a terminal."""
    names = [escape_controls(n) if escape else n for n in table.column_names]
    rows = [[_cell(v, escape) for v in r.values()] for r in table.slice(0, max_rows).to_pylist()]
    widths = [max([len(n)] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]
    line = "  ".join(n.ljust(w) for n, w in zip(names, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if table.num_rows > max_rows:
        out.append(f"... {table.num_rows - max_rows} more rows (use --format/--out for all)")
    out.append(f"({table.num_rows} rows)")
    return "\n".join(out)


def write_result(table: pa.Table, fmt: str, out: str | None) -> None:
    """Write a query result; files are written here, never by SQL (and never into a store)."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from rolloutstore.io.outputs import open_output, output_target

    target = output_target(out, what="--out file") if out else None
    if fmt == "parquet":
        if target is None:
            raise UsageError("--format parquet needs --out FILE")
        with open_output(target) as f:  # a file object: pyarrow removes a path it fails to write
            pq.write_table(table, f, compression="zstd")
        return
    if fmt == "table":
        text = format_table(table, max_rows=table.num_rows if out else 50, escape=not out) + "\n"
    elif fmt == "json":
        text = "".join(json.dumps(r, default=str) + "\n" for r in table.to_pylist())
    else:  # csv
        import io

        buf = io.BytesIO()
        flat = pa.table(
            {
                n: (
                    c
                    if not pa.types.is_nested(c.type)
                    else pa.array([json.dumps(v) for v in c.to_pylist()])
                )
                for n, c in zip(table.column_names, table.columns)
            }
        )
        pcsv.write_csv(flat, buf)
        text = buf.getvalue().decode()
    if target is not None:
        with open_output(target) as f:
            f.write(text.encode())
    else:
        sys.stdout.write(text)


def print_stats(st: dict) -> None:
    gib = st["bytes_on_disk"]
    print(f"store      {st['uri']} (version {st['version']}, {st['fragments']} fragments)")
    print(
        f"rollouts   {st['rows']:,} in {st['groups']:,} groups, {st['prompts']:,} prompts, {st['runs']} runs"
    )
    print(
        f"tokens     {st['tokens']:,} ({st['prompt_tokens']:,} prompt + {st['completion_tokens']:,} completion)"
    )
    if gib is not None:
        bpt = st["bytes_per_token"]
        print(f"on disk    {gib / 2**20:,.1f} MiB" + (f", {bpt:.2f} bytes/token" if bpt else ""))
    if st["by_policy_version"]:
        print("policy_version  rollouts  reward_mean")
        for r in st["by_policy_version"]:
            mean = "-" if r["reward_mean"] is None else f"{r['reward_mean']:.4f}"
            print(f"{r['policy_version']:>14}  {r['rollouts']:>8}  {mean:>11}")
    if st["reuse"]:
        print("uses  rollouts")
        for r in st["reuse"]:
            print(f"{r['uses']:>4}  {r['rollouts']:>8}")
