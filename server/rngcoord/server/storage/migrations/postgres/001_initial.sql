-- rngcoord schema, version 1 (PostgreSQL and Postgres-compatible engines).
-- Same tables, columns and meaning as migrations/sqlite/001_initial.sql. Every uint64 (seeds,
-- offsets, sizes, cursors) is stored biased, v - 2^63, in a signed BIGINT so that ORDER BY and
-- comparisons keep the unsigned order. "end" and "cursor" are quoted because PostgreSQL
-- reserves them. Portable DDL only: no sequences, no triggers, no vendor types beyond BYTEA.
-- Replicas that start together take turns on an advisory lock (server/postgres.py), and the
-- whole script runs in one transaction, so it needs no IF NOT EXISTS.

CREATE TABLE jobs (
    job         TEXT    NOT NULL PRIMARY KEY,
    seed        BIGINT  NOT NULL,
    created_us  BIGINT  NOT NULL
);

-- epoch: the current epoch, 0 before the first forms. high_water: one past the highest
-- offset ever granted in the group.
CREATE TABLE groups (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    seed        BIGINT  NOT NULL,
    epoch       BIGINT  NOT NULL DEFAULT 0,
    high_water  BIGINT  NOT NULL,
    PRIMARY KEY (job, grp)
);

-- members: JSON list of member ids by rank, "" for a rank that left. diverged: the
-- divergence message once one is detected; the epoch refuses leases from then on.
CREATE TABLE epochs (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       BIGINT  NOT NULL,
    world_size  BIGINT  NOT NULL,
    start       BIGINT  NOT NULL,
    members     TEXT    NOT NULL,
    diverged    TEXT    NULL,
    created_us  BIGINT  NOT NULL,
    PRIMARY KEY (job, grp, epoch)
);

CREATE TABLE pending_joins (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    rank        BIGINT  NOT NULL,
    member_id   TEXT    NOT NULL,
    world_size  BIGINT  NOT NULL,
    expires_us  BIGINT  NOT NULL,
    PRIMARY KEY (job, grp, rank)
);

-- rank and member_id: the first requester of the lease.
CREATE TABLE leases (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       BIGINT  NOT NULL,
    seq         BIGINT  NOT NULL,
    start       BIGINT  NOT NULL,
    "end"       BIGINT  NOT NULL,
    size        BIGINT  NOT NULL,
    fingerprint BYTEA   NOT NULL,
    rank        BIGINT  NOT NULL,
    member_id   TEXT    NOT NULL,
    created_us  BIGINT  NOT NULL,
    PRIMARY KEY (job, grp, epoch, seq)
);

CREATE TABLE restores (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       BIGINT  NOT NULL,
    seq         BIGINT  NOT NULL,
    "cursor"    BIGINT  NOT NULL,
    created_us  BIGINT  NOT NULL,
    PRIMARY KEY (job, grp, epoch, seq)
);

-- The hash chain: id counts from 1 without gaps; see server/audit.py for the hashing.
CREATE TABLE audit (
    id          BIGINT  NOT NULL PRIMARY KEY,
    ts_us       BIGINT  NOT NULL,
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    kind        TEXT    NOT NULL,
    actor       TEXT    NOT NULL,
    detail      TEXT    NOT NULL,
    prev_hash   TEXT    NOT NULL,
    hash        TEXT    NOT NULL
);

-- The chain's head, one row: appends read and advance it in the writing transaction. Every
-- write transaction locks it first (SELECT ... FOR UPDATE), which serialises writers across
-- replicas.
CREATE TABLE audit_head (
    id          BIGINT  NOT NULL PRIMARY KEY,
    last_id     BIGINT  NOT NULL,
    last_hash   TEXT    NOT NULL
);

INSERT INTO audit_head (id, last_id, last_hash)
VALUES (1, 0, '0000000000000000000000000000000000000000000000000000000000000000')
ON CONFLICT DO NOTHING;
