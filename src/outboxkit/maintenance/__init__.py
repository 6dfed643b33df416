"""Maintenance chores, one per module, none with SQL in it: each decides, a backend runs it.

- :mod:`~outboxkit.maintenance.partitions`: which time partitions to create ahead and which
  have expired (backends/postgres/partitions.py reads and changes them);
- :mod:`~outboxkit.maintenance.side_task`: the relay's side task that runs the partition
  maintenance every few minutes;
- :mod:`~outboxkit.maintenance.purge`: deleting old published rows and inbox records in
  small batches.
"""
