-- Schema version 2 of ordered mode on MariaDB/MySQL: the ordered claim's two indexes that
-- keep it O(batch) (tests/integration/test_mariadb_claim_plan.py measures it).
-- {index_pending_id}: pending rows in id order, so the claim's scan stops after its batch
-- instead of reading and sorting every pending row of the relay's partitions.
-- {index_key_status} replaces {index_key_head} (`key`, id): per key, the rows of one status,
-- so looking for a key's unsettled earlier rows skips its published history.
-- Placeholders: {table} and the three indexes (quoted identifiers).

CREATE INDEX IF NOT EXISTS {index_pending_id} ON {table} (status, id);
CREATE INDEX IF NOT EXISTS {index_key_status} ON {table} (`key`(255), status, id);
DROP INDEX IF EXISTS {index_key_head} ON {table};
