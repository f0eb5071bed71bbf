-- rngcoord schema, version 1 (SQLite).
-- Same tables, columns and meaning as migrations/postgres/001_initial.sql. Every uint64 (seeds,
-- offsets, sizes, cursors) is stored biased, v - 2^63, in a signed 64-bit INTEGER so that
-- ORDER BY and comparisons keep the unsigned order. "end" and "cursor" are quoted because
-- PostgreSQL reserves them, and the coordinator's SQL is shared by both dialects.
-- WITHOUT ROWID: every lookup is by primary key, so the table is the key's B-tree.

CREATE TABLE jobs (
    job         TEXT    NOT NULL PRIMARY KEY,
    seed        INTEGER NOT NULL,
    created_us  INTEGER NOT NULL
) WITHOUT ROWID;

-- epoch: the current epoch, 0 before the first forms. high_water: one past the highest
-- offset ever granted in the group.
CREATE TABLE groups (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    seed        INTEGER NOT NULL,
    epoch       INTEGER NOT NULL DEFAULT 0,
    high_water  INTEGER NOT NULL,
    PRIMARY KEY (job, grp)
) WITHOUT ROWID;

-- members: JSON list of member ids by rank, "" for a rank that left. diverged: the
-- divergence message once one is detected; the epoch refuses leases from then on.
CREATE TABLE epochs (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       INTEGER NOT NULL,
    world_size  INTEGER NOT NULL,
    start       INTEGER NOT NULL,
    members     TEXT    NOT NULL,
    diverged    TEXT    NULL,
    created_us  INTEGER NOT NULL,
    PRIMARY KEY (job, grp, epoch)
) WITHOUT ROWID;

CREATE TABLE pending_joins (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    rank        INTEGER NOT NULL,
    member_id   TEXT    NOT NULL,
    world_size  INTEGER NOT NULL,
    expires_us  INTEGER NOT NULL,
    PRIMARY KEY (job, grp, rank)
) WITHOUT ROWID;

-- rank and member_id: the first requester of the lease.
CREATE TABLE leases (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    start       INTEGER NOT NULL,
    "end"       INTEGER NOT NULL,
    size        INTEGER NOT NULL,
    fingerprint BLOB    NOT NULL,
    rank        INTEGER NOT NULL,
    member_id   TEXT    NOT NULL,
    created_us  INTEGER NOT NULL,
    PRIMARY KEY (job, grp, epoch, seq)
) WITHOUT ROWID;

CREATE TABLE restores (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    "cursor"    INTEGER NOT NULL,
    created_us  INTEGER NOT NULL,
    PRIMARY KEY (job, grp, epoch, seq)
) WITHOUT ROWID;

-- The hash chain: id counts from 1 without gaps; see server/audit.py for the hashing.
CREATE TABLE audit (
    id          INTEGER NOT NULL PRIMARY KEY,
    ts_us       INTEGER NOT NULL,
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    kind        TEXT    NOT NULL,
    actor       TEXT    NOT NULL,
    detail      TEXT    NOT NULL,
    prev_hash   TEXT    NOT NULL,
    hash        TEXT    NOT NULL
);

-- The chain's head, one row: appends read and advance it in the writing transaction.
CREATE TABLE audit_head (
    id          INTEGER NOT NULL PRIMARY KEY,
    last_id     INTEGER NOT NULL,
    last_hash   TEXT    NOT NULL
);

INSERT INTO audit_head (id, last_id, last_hash)
VALUES (1, 0, '0000000000000000000000000000000000000000000000000000000000000000')
ON CONFLICT DO NOTHING;
