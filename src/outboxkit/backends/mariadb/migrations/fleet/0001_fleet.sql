-- Schema version 1 of the fleet's lease table on MariaDB/MySQL (fleet processes given one DSN
-- file divide its databases: backends/mariadb/fleet_sql.py): PostgreSQL's outboxkit_fleet in
-- MariaDB types. A row per fleet process that saw the database within a lease, per service.
-- MariaDB has no partial indexes: PostgreSQL's unique index on (service) WHERE owner becomes
-- a unique index on a stored generated column that is NULL in every row but an owner's, so
-- the database itself keeps at most one owner per service. Times are UTC DATETIME(6).
-- Placeholders: {table}, {index_owner} (quoted identifiers).

CREATE TABLE IF NOT EXISTS {table} (
    service    VARCHAR(255) NOT NULL,
    member     VARCHAR(255) NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    owner      BOOLEAN NOT NULL DEFAULT FALSE,
    owned      VARCHAR(255) AS (IF(owner, service, NULL)) STORED,
    PRIMARY KEY (service, member),
    UNIQUE KEY {index_owner} (owned)
) ENGINE = InnoDB;
