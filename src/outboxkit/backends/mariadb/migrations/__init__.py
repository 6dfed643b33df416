"""MariaDB's schema as versioned ``.sql`` files: a folder per kind of table, a file per version."""
