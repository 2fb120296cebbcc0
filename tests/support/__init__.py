"""Test support shared by tests/ and model_check/: toy device programs, the one-request oracle, workload
drivers, engine invariants, process helpers (the CLI's argv), source-level mutants and the server harness.
Importable as `support.*` because pytest's `pythonpath` (pyproject.toml) puts tests/ on the path; nothing
here ships in the package."""
