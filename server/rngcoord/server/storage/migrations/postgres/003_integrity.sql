-- rngcoord schema, version 3 (PostgreSQL): the store's identity, a keyed audit chain, Restore
-- by consensus and floors. Same meaning as migrations/sqlite/003_integrity.sql.
CREATE TABLE meta (
    name        TEXT    NOT NULL PRIMARY KEY,
    value       TEXT    NOT NULL
);

INSERT INTO meta (name, value) VALUES ('store_id', md5(random()::text || clock_timestamp()::text));
INSERT INTO meta (name, value) VALUES ('audit_key_id', '');
INSERT INTO meta (name, value) VALUES ('keyed_from', '0');

CREATE TABLE restore_votes (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       BIGINT  NOT NULL,
    seq         BIGINT  NOT NULL,
    rank        BIGINT  NOT NULL,
    "cursor"    BIGINT  NOT NULL,
    member_id   TEXT    NOT NULL,
    actor       TEXT    NOT NULL,
    created_us  BIGINT  NOT NULL,
    PRIMARY KEY (job, grp, epoch, seq, rank)
);

CREATE TABLE restore_tallies (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       BIGINT  NOT NULL,
    seq         BIGINT  NOT NULL,
    "cursor"    BIGINT  NOT NULL,
    votes       BIGINT  NOT NULL,
    PRIMARY KEY (job, grp, epoch, seq)
);

ALTER TABLE epochs ADD COLUMN left_count BIGINT NOT NULL DEFAULT 0;
UPDATE epochs SET left_count = (
    SELECT COUNT(*) FROM members m
    WHERE m.job = epochs.job AND m.grp = epochs.grp AND m.epoch = epochs.epoch
    AND m.left_us IS NOT NULL
);

CREATE TABLE floors (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    floor       BIGINT  NOT NULL,
    PRIMARY KEY (job, grp)
);
