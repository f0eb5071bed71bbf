-- rngcoord schema, version 4 (PostgreSQL): op-count attestations. Same meaning as
-- migrations/sqlite/004_attestations.sql.
--
-- attestations: the first fingerprint attested for (epoch, anchor_seq, ops) of a group, and the
-- rank that sent it. Later attestations of the same key are compared with it and write nothing.
CREATE TABLE attestations (
    job         TEXT    NOT NULL,
    grp         TEXT    NOT NULL,
    epoch       BIGINT  NOT NULL,
    anchor_seq  BIGINT  NOT NULL,
    ops         BIGINT  NOT NULL,
    fingerprint BYTEA   NOT NULL,
    rank        BIGINT  NOT NULL,
    created_us  BIGINT  NOT NULL,
    PRIMARY KEY (job, grp, epoch, anchor_seq, ops)
);
