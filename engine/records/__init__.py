"""A request's books: stage and status names, its trace, the metrics record and the SQLite store."""
