"""The SQLite backend: one file, one process (the embedded default)."""
