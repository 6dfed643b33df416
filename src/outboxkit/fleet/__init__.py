"""One process, many databases: the DSN file (dsn_file.py) and the supervisor that runs one
relay per database listed in it (supervisor.py), reloading the file while it runs."""
