"""After training: what each component does over a corpus (`pdctl harvest`, `run`), counted by
`accumulate` and stored in SQLite by `db`."""
