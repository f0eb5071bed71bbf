-- rngcoord schema, version 5 (PostgreSQL): member credentials and the sides of a divergence.
-- Same meaning as migrations/sqlite/005_member_credentials.sql.
--
-- secret_hash: SHA-256 of the member secret the rank joined with (JoinGroupRequest.
-- member_secret); every later call as that member must carry the same secret. Members of
-- epochs formed before this version have none, and must join again.
ALTER TABLE pending_joins ADD COLUMN secret_hash BYTEA NULL;
ALTER TABLE members ADD COLUMN secret_hash BYTEA NULL;

-- Who sent a lease's fingerprint, and the first attestation of a count: the token identity
-- (actor) and the address (peer), so that a divergence names who spoke first.
ALTER TABLE leases ADD COLUMN actor TEXT NOT NULL DEFAULT '';
ALTER TABLE leases ADD COLUMN peer TEXT NOT NULL DEFAULT '';
ALTER TABLE attestations ADD COLUMN actor TEXT NOT NULL DEFAULT '';
ALTER TABLE attestations ADD COLUMN peer TEXT NOT NULL DEFAULT '';

-- divergence_sides: once an epoch diverged at a point (`at`: "seq:N" for a lease, or
-- "ops:ANCHOR:N" for an attestation), what each rank that spoke there sent. The first
-- speaker's row has first = 1. Written only in a diverged epoch, at most one row per rank.
CREATE TABLE divergence_sides (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       BIGINT  NOT NULL,
    at          TEXT    NOT NULL,
    rank        BIGINT  NOT NULL,
    side        TEXT    NOT NULL,
    first       BIGINT  NOT NULL,
    actor       TEXT    NOT NULL,
    peer        TEXT    NOT NULL,
    created_us  BIGINT  NOT NULL,
    PRIMARY KEY (job, grp, epoch, at, rank)
);
