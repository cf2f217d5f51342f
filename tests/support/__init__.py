"""Helpers shared by the test folders, imported as `support.<module>`: tests/ is on sys.path because
pytest imports tests/conftest.py from there (rootdir-relative `prepend` import mode)."""
