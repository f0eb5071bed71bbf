-- rngcoord schema, version 7 (PostgreSQL): resumes that could not rewind.
-- Same meaning as migrations/sqlite/007_resizes.sql.
--
-- One row per (job, group, epoch, saved group): a checkpoint saved in saved_grp, which the
-- epoch's mesh never joins (a job resumed on another mesh under the offsets policy), so grp
-- continued from its own position and not from saved_cursor. The row makes RecordResize
-- idempotent; the audit record of kind 'resize' written with it is what auditors read.
-- saved_cursor is a uint64 stored biased, as in 001_initial.sql.
CREATE TABLE resizes (
    job TEXT NOT NULL,
    grp TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    saved_grp TEXT NOT NULL,
    saved_cursor BIGINT NOT NULL,
    created_us BIGINT NOT NULL,
    PRIMARY KEY (job, grp, epoch, saved_grp)
);
