"""The private MariaDB the tests start: its own server, on loopback, not the machine's."""

from __future__ import annotations

import pymysql

from tests.support.mariadb import MariaDB


def test_private_mariadb_serves_skip_locked_on_its_own_port(mariadb_server: MariaDB) -> None:
    assert mariadb_server.port != 3306
    conn = pymysql.connect(**mariadb_server.connect_args(), autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT VERSION()")
            (version,) = cur.fetchone()
            assert "MariaDB" in version
            cur.execute("CREATE DATABASE probe")
            cur.execute("CREATE TABLE probe.t (id INT PRIMARY KEY)")
            cur.execute("INSERT INTO probe.t VALUES (1), (2)")
            # SKIP LOCKED (10.6+) is what the claim is built on.
            cur.execute("BEGIN")
            cur.execute("SELECT id FROM probe.t ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED")
            assert cur.fetchall() == ((1,),)
            cur.execute("ROLLBACK")
            cur.execute("DROP DATABASE probe")
    finally:
        conn.close()
