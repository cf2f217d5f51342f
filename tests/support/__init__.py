"""Helpers shared by the test folders, imported as `support.<module>`.

pytest's default `prepend` import mode puts tests/ on sys.path when it imports tests/conftest.py, so
`support` is found from every folder. The test folders themselves are not packages (no `__init__.py`):
each test file is imported by its base name, so two test files may not share one."""
