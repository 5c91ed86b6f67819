#!/usr/bin/env python3
"""Per-kernel table of an Nsight Compute CSV (`ncu --csv --metrics
gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size`), e.g. of `sala bench`'s decode
steps (`ncu --profile-from-start off`: the bench opens the profiler range around them).

Kernels are grouped by name and grid; for each group: launches, device us a launch, the share
of all the kernels' time, DRAM bytes read a launch and their rate. Device times are each
kernel's alone (Nsight serializes launches), so the sum is a step without overlap.
Usage: scripts/ncu-table.py FILE.csv [STEPS]   (STEPS: divide the totals by it)"""
import collections
import csv
import sys


def main():
    path = sys.argv[1]
    steps = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    kernels = collections.OrderedDict()
    for row in csv.DictReader(lines):
        k = kernels.setdefault(row["ID"], {"name": row["Kernel Name"].split("(")[0]})
        value = row["Metric Value"].replace(",", "")
        unit = row["Metric Unit"]
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
                 "B": 1.0, "byte": 1.0, "KB": 1e3, "Kbyte": 1e3, "MB": 1e6, "Mbyte": 1e6, "GB": 1e9,
                 "Gbyte": 1e9}.get(unit, 1.0)
        try:
            k[row["Metric Name"]] = float(value) * scale
        except ValueError:
            k[row["Metric Name"]] = value
    groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in kernels.values():
        key = (k["name"], int(k.get("launch__grid_size", 0)))
        g = groups[key]
        g[0] += 1
        g[1] += k.get("gpu__time_duration.sum", 0.0)
        g[2] += k.get("dram__bytes_read.sum", 0.0)
    total = sum(g[1] for g in groups.values())
    print(f"{len(kernels)} launches, {total / 1e3 / steps:.3f} ms of kernel time a step ({steps:g} steps)")
    print(f"{'us/step':>9} {'share':>6} {'calls/step':>10} {'us/call':>8} {'MB/call':>8} {'TB/s':>6}  kernel (grid)")
    for (name, grid), (n, us, b) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{us / steps:9.1f} {100 * us / total:5.1f}% {n / steps:10.1f} {us / n:8.2f} "
              f"{b / n / 1e6:8.2f} {b / us / 1e6 if us else 0:6.2f}  {name} ({grid})")


if __name__ == "__main__":
    main()
