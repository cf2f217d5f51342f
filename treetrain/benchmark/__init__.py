"""The geometry benchmark: `flat`, `exact` and `response_only` measured side by side (`bench/geometry.py`).

- `config`: the grid and every setting of a run (`BenchConfig`, `FULL`, `QUICK`);
- `workload`: the model, the synthetic update for one grid point, and one update in each mode;
- `timing`: interleaved repetitions and medians;
- `memory`: measured (tracker) and predicted (ledger) peaks by lifetime class;
- `search`: the longest prefix that fits a memory limit in each mode;
- `results`: typed results, the targets, and their JSON form;
- `report`: the markdown table and PNG plots;
- `suite`: runs everything in order.
"""
