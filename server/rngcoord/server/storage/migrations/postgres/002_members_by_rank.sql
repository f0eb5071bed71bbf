-- rngcoord schema, version 2 (PostgreSQL): membership stored by (epoch, rank), O(1) per
-- request. Same meaning as migrations/sqlite/002_members_by_rank.sql.
CREATE TABLE members (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       BIGINT  NOT NULL,
    rank        BIGINT  NOT NULL,
    member_id   TEXT    NOT NULL,
    joined_us   BIGINT  NOT NULL,
    left_us     BIGINT  NULL,
    peer        TEXT    NOT NULL DEFAULT '',
    PRIMARY KEY (job, grp, epoch, rank)
);

INSERT INTO members (job, grp, epoch, rank, member_id, joined_us, left_us, peer)
SELECT e.job, e.grp, e.epoch, m.ordinality - 1, m.value, e.created_us,
       CASE WHEN m.value = '' THEN e.created_us END, ''
FROM epochs e, jsonb_array_elements_text(e.members::jsonb) WITH ORDINALITY AS m(value, ordinality);

ALTER TABLE epochs ADD COLUMN members_digest BYTEA NOT NULL DEFAULT '\x'::bytea;
ALTER TABLE epochs DROP COLUMN members;

ALTER TABLE groups ADD COLUMN barrier_size BIGINT NOT NULL DEFAULT 0;
ALTER TABLE groups ADD COLUMN barrier_count BIGINT NOT NULL DEFAULT 0;
UPDATE groups SET
    barrier_count = (SELECT COUNT(*) FROM pending_joins p WHERE p.job = groups.job AND p.grp = groups.grp),
    barrier_size = COALESCE((SELECT MAX(world_size) FROM pending_joins p WHERE p.job = groups.job AND p.grp = groups.grp), 0);

ALTER TABLE pending_joins ADD COLUMN joined_us BIGINT NOT NULL DEFAULT 0;
ALTER TABLE pending_joins ADD COLUMN peer TEXT NOT NULL DEFAULT '';
CREATE INDEX pending_joins_by_expiry ON pending_joins (job, grp, expires_us);

CREATE INDEX audit_by_group ON audit (job, grp, id);
