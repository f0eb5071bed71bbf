-- rngcoord schema, version 2 (SQLite): membership stored by (epoch, rank), O(1) per request.
-- Same meaning as migrations/postgres/002_members_by_rank.sql.
--
-- members: one row per rank of an epoch. left_us: when the member left (NULL while it is in).
-- Epochs written before this version kept "" for a rank that left, and no join time: those
-- rows carry member_id '' and the epoch's creation time.
CREATE TABLE members (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       INTEGER NOT NULL,
    rank        INTEGER NOT NULL,
    member_id   TEXT    NOT NULL,
    joined_us   INTEGER NOT NULL,
    left_us     INTEGER NULL,
    peer        TEXT    NOT NULL DEFAULT '',
    PRIMARY KEY (job, grp, epoch, rank)
) WITHOUT ROWID;

INSERT INTO members (job, grp, epoch, rank, member_id, joined_us, left_us, peer)
SELECT e.job, e.grp, e.epoch, CAST(m.key AS INTEGER), m.value, e.created_us,
       CASE WHEN m.value = '' THEN e.created_us END, ''
FROM epochs e, json_each(e.members) m;

-- members_digest: SHA-256 of "RANK:MEMBER_ID\n" over the ranks in order (rngcoord.v1.types);
-- empty for epochs formed before this version.
ALTER TABLE epochs ADD COLUMN members_digest BLOB NOT NULL DEFAULT x'';
ALTER TABLE epochs DROP COLUMN members;

-- The join barrier's state: how many ranks wait (barrier_count) with which world size
-- (barrier_size, 0 when none waits). Kept with the group so that a join costs O(1).
ALTER TABLE groups ADD COLUMN barrier_size INTEGER NOT NULL DEFAULT 0;
ALTER TABLE groups ADD COLUMN barrier_count INTEGER NOT NULL DEFAULT 0;
UPDATE groups SET
    barrier_count = (SELECT COUNT(*) FROM pending_joins p WHERE p.job = groups.job AND p.grp = groups.grp),
    barrier_size = COALESCE((SELECT MAX(world_size) FROM pending_joins p WHERE p.job = groups.job AND p.grp = groups.grp), 0);

ALTER TABLE pending_joins ADD COLUMN joined_us INTEGER NOT NULL DEFAULT 0;
ALTER TABLE pending_joins ADD COLUMN peer TEXT NOT NULL DEFAULT '';
-- Joins sweep the expired rows of their group, each row once.
CREATE INDEX pending_joins_by_expiry ON pending_joins (job, grp, expires_us);

-- ListAudit and the status page read one group's records.
CREATE INDEX audit_by_group ON audit (job, grp, id);
