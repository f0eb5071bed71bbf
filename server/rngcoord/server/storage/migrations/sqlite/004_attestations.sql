-- rngcoord schema, version 4 (SQLite): op-count attestations. Same meaning as
-- migrations/postgres/004_attestations.sql.
--
-- attestations: the first fingerprint attested for (epoch, anchor_seq, ops) of a group, and the
-- rank that sent it. Later attestations of the same key are compared with it and write nothing.
CREATE TABLE attestations (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       INTEGER NOT NULL,
    anchor_seq  INTEGER NOT NULL,
    ops         INTEGER NOT NULL,
    fingerprint BLOB    NOT NULL,
    rank        INTEGER NOT NULL,
    created_us  INTEGER NOT NULL,
    PRIMARY KEY (job, grp, epoch, anchor_seq, ops)
) WITHOUT ROWID;
