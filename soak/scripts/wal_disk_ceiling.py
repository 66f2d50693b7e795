#!/usr/bin/env python3
"""The disk's ceiling for a per-batch-durable WAL (issue 7).

Appends RECORD bytes and fsyncs, BATCHES times in a row, as `Table::insert` does with
`WalSync::PerBatch` (one record per 8,192-row batch), and prints the sustained rate and the
rows/s it allows at ROWS rows per record: the insert cannot be faster than this with zero CPU.

    python3 soak/scripts/wal_disk_ceiling.py [DIR] [RECORD_BYTES] [BATCHES] [ROWS]

Defaults: the current directory, 1,384,000 bytes (8,192 lineitem rows at 169 bytes, the WAL
record since view columns are logged as offset columns), 200 records, 8,192 rows.
"""
import os
import statistics
import sys
import time

d = sys.argv[1] if len(sys.argv) > 1 else "."
size = int(sys.argv[2]) if len(sys.argv) > 2 else 8192 * 169
n = int(sys.argv[3]) if len(sys.argv) > 3 else 200
rows = int(sys.argv[4]) if len(sys.argv) > 4 else 8192
path = os.path.join(d, "wal-ceiling.tmp")
buf = os.urandom(size)
fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
lat = []
try:
    start = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        os.write(fd, buf)
        os.fsync(fd)
        lat.append(time.perf_counter() - t)
    total = time.perf_counter() - start
finally:
    os.close(fd)
    os.remove(path)
mb_s = n * size / total / 1e6
print(f"{n} records of {size} bytes, write + fsync each: {mb_s:.0f} MB/s sustained, "
      f"median {statistics.median(lat) * 1e3:.2f} ms, p90 {sorted(lat)[n * 9 // 10] * 1e3:.2f} ms")
print(f"ceiling at {rows} rows per record: {n * rows / total / 1e6:.2f} M rows/s "
      f"(first 20 records: {20 * rows / sum(lat[:20]) / 1e6:.2f} M rows/s)")
