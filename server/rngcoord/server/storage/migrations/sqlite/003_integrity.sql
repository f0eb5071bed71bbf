-- rngcoord schema, version 3 (SQLite): the store's identity, a keyed audit chain, Restore by
-- consensus and floors. Same meaning as migrations/postgres/003_integrity.sql.
--
-- meta: the store's facts. store_id: drawn when the store is created (or upgraded to this
-- version), never changed; clients keep it and stop when a coordinator answers with another.
-- audit_key_id: which key MACs the chain from record keyed_from on ('' and 0: unkeyed).
CREATE TABLE meta (
    name        TEXT    NOT NULL PRIMARY KEY,
    value       TEXT    NOT NULL
) WITHOUT ROWID;

INSERT INTO meta (name, value) VALUES ('store_id', lower(hex(randomblob(16))));
INSERT INTO meta (name, value) VALUES ('audit_key_id', '');
INSERT INTO meta (name, value) VALUES ('keyed_from', '0');

-- A Restore takes effect once every current member of the epoch has asked for the same
-- (seq, cursor); until then each request is a vote.
CREATE TABLE restore_votes (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    rank        INTEGER NOT NULL,
    "cursor"    INTEGER NOT NULL,
    member_id   TEXT    NOT NULL,
    actor       TEXT    NOT NULL,
    created_us  INTEGER NOT NULL,
    PRIMARY KEY (job, grp, epoch, seq, rank)
) WITHOUT ROWID;

-- One row per Restore being voted on: the cursor asked for, and how many members asked.
CREATE TABLE restore_tallies (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    "cursor"    INTEGER NOT NULL,
    votes       INTEGER NOT NULL,
    PRIMARY KEY (job, grp, epoch, seq)
) WITHOUT ROWID;

-- Members of the epoch that left, so that a Restore knows how many votes it needs in O(1).
ALTER TABLE epochs ADD COLUMN left_count INTEGER NOT NULL DEFAULT 0;
UPDATE epochs SET left_count = (
    SELECT COUNT(*) FROM members m
    WHERE m.job = epochs.job AND m.grp = epochs.grp AND m.epoch = epochs.epoch
    AND m.left_us IS NOT NULL
);

-- Floors from a lost store (`rngcoord serve --init --floor-from`): a group created here starts
-- at its floor, so nothing granted from the lost store is granted again. grp '' holds a floor
-- for every group of the job, and job '' one for every job.
CREATE TABLE floors (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    floor       INTEGER NOT NULL,
    PRIMARY KEY (job, grp)
) WITHOUT ROWID;
