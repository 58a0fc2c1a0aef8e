"""Storage backends. Today only the PostgreSQL groundwork for scale-out lives here; the SQLite
modules (db, devices, outbox, seen, ...) move in once both engines share one interface."""
