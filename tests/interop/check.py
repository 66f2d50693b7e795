#!/usr/bin/env python3
"""Reads Parquet files written by gritdb with pyarrow and with DuckDB and prints, per reader,
one JSON line: row count and exact column sums (as unscaled integers, e.g. hundredths for
DECIMAL(15,2)), so the Rust test in tests/all/interop.rs can compare them with gritdb's scan.

Usage:
  check.py [--columns a,b] FILE [FILE ...]
      read these files (together, as one table)
  check.py [--columns a,b] [--allow-deletion-vectors] --gritdb-table DATA_DIR TABLE
      read the data files the committed manifest of gritdb table TABLE names
      (DATA_DIR/tables/t<id>/manifest.json). Unless --allow-deletion-vectors, fails (exit 3)
      when a file still has a deletion vector: those rows would be counted by other engines.

Output (stdout), one JSON object per line:
  {"reader": "manifest", "files": [...], "deleted_rows": N}        (--gritdb-table only)
  {"reader": "pyarrow", "version": "...", "count": N, "sums": {"col": N, ...}, "scales": {...}}
  {"reader": "duckdb", "version": "...", "count": N, "sums": {...}, "scales": {...}}

Exit codes: 0 ok, 2 python packages missing (stderr names them: `pip install pyarrow duckdb`),
3 deletion vectors present, 1 any other failure.
"""

import decimal
import glob
import json
import os
import sys

decimal.getcontext().prec = 60


def unscaled(value, scale):
    """An exact sum (int or Decimal) as an integer in units of 10**-scale."""
    if value is None:
        return 0
    return int(decimal.Decimal(value).scaleb(scale).to_integral_exact())


def scale_of(pa, typ):
    if pa.types.is_decimal(typ):
        return typ.scale
    if pa.types.is_integer(typ):
        return 0
    raise SystemExit(f"check.py: column type {typ} is not an integer or decimal; sums must be exact")


def with_pyarrow(pa, pq, files, columns):
    import pyarrow.compute as pc

    table = pq.ParquetDataset(files).read(columns=columns) if columns else pq.ParquetDataset(files).read()
    out = {"reader": "pyarrow", "version": pa.__version__, "count": table.num_rows, "sums": {}, "scales": {}}
    for c in columns:
        col = table.column(c)
        scale = scale_of(pa, col.type)
        out["sums"][c] = unscaled(pc.sum(col).as_py(), scale)
        out["scales"][c] = scale
    return out


def with_duckdb(duckdb, files, columns):
    con = duckdb.connect()
    sums = "".join(f', sum("{c}")' for c in columns)
    row = con.execute(f"select count(*){sums} from read_parquet(?)", [files]).fetchone()
    types = {}
    if columns:
        desc = con.execute(f"describe select {', '.join(chr(34) + c + chr(34) for c in columns)} from read_parquet(?)", [files]).fetchall()
        types = {r[0]: r[1] for r in desc}
    out = {"reader": "duckdb", "version": duckdb.__version__, "count": int(row[0]), "sums": {}, "scales": {}}
    for i, c in enumerate(columns):
        t = types[c].upper()
        scale = int(t.split(",")[1].rstrip(")").strip()) if t.startswith("DECIMAL") else 0
        out["sums"][c] = unscaled(row[1 + i], scale)
        out["scales"][c] = scale
    return out


def table_files(data_dir, table, allow_dv):
    for manifest_path in sorted(glob.glob(os.path.join(data_dir, "tables", "t*", "manifest.json"))):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest.get("table") != table:
            continue
        tdir = os.path.dirname(manifest_path)
        files = [os.path.join(tdir, fm["name"]) for fm in manifest["files"]]
        deleted = sum(fm.get("deleted", 0) for fm in manifest["files"])
        with_dv = [fm["name"] for fm in manifest["files"] if fm.get("dv") or fm.get("deleted", 0)]
        print(json.dumps({"reader": "manifest", "manifest": manifest_path, "version": manifest.get("version"),
                          "files": files, "deleted_rows": deleted, "files_with_deletion_vectors": with_dv}), flush=True)
        if with_dv and not allow_dv:
            print(f"check.py: files {with_dv} of table {table!r} still have deletion vectors ({deleted} rows): "
                  "other engines would read deleted rows; compact first or use Table::export_parquet", file=sys.stderr)
            sys.exit(3)
        return files
    print(f"check.py: no table {table!r} under {data_dir}/tables", file=sys.stderr)
    sys.exit(1)


def main(argv):
    columns = ["l_quantity", "l_extendedprice"]
    allow_dv = False
    table = None
    args = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--columns":
            columns = [c for c in argv[i + 1].split(",") if c]
            i += 2
        elif a == "--allow-deletion-vectors":
            allow_dv = True
            i += 1
        elif a == "--gritdb-table":
            table = (argv[i + 1], argv[i + 2])
            i += 3
        else:
            args.append(a)
            i += 1

    missing = []
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        missing.append("pyarrow")
    try:
        import duckdb
    except ImportError:
        missing.append("duckdb")
    if missing:
        print(f"check.py: python packages missing: {' '.join(missing)} (pip install pyarrow duckdb)", file=sys.stderr)
        sys.exit(2)

    files = table_files(table[0], table[1], allow_dv) if table else args
    if not files:
        print("check.py: no Parquet files given", file=sys.stderr)
        sys.exit(1)
    for f in files:
        if not os.path.isfile(f):
            print(f"check.py: {f} is not a file", file=sys.stderr)
            sys.exit(1)
    print(json.dumps(with_pyarrow(pa, pq, files, columns)), flush=True)
    print(json.dumps(with_duckdb(duckdb, files, columns)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
