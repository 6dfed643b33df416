"""The WAL relay's source: the logical replication stream (pgoutput), its slot, its publication.

`pgoutput.py` decodes the protocol (pure), `stream.py` reads a slot through psycopg2's
replication connection (the `cdc` extra), `slots.py` sets up, reports on and drops the slot and
publication. Nothing is imported here, so `import outboxkit.cdc` needs no extra.
"""
