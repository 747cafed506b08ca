"""dsv4ray.bench: the benchmarks (``python -m dsv4ray.bench`` lists them; each writes
bench/results/<benchmark>-<device>.json through report.py) and their helpers."""
