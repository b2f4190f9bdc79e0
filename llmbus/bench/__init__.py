"""The benchmark harness (`llmbus bench`): load generation, datasets, reports.

NOTE: record, metrics, report, arrivals and datasets import only the standard library (plus
`tokenizers` for datasets), so the peers' own venvs (scripts/peers/) can write the same report.
"""
