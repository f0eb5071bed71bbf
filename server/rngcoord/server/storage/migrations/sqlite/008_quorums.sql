-- rngcoord schema, version 8 (SQLite): the torchft quorums a replica took part in.
-- Same meaning as migrations/postgres/008_quorums.sql.
--
-- One row per (job, group, epoch, quorum id): grp is a replica's group (its name ends in
-- /replica:NAME), and the row says that the replica took part in torchft quorum quorum_id,
-- formed at step, with participants replicas, healing from the replica healed_from ('' when
-- it did not heal). The row makes RecordQuorum idempotent; the audit record of kind 'quorum'
-- written with it is what auditors read. quorum_id is a uint64 stored biased, as in
-- 001_initial.sql; step is below 2^63.
CREATE TABLE quorums (
    job TEXT NOT NULL,
    grp TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    quorum_id INTEGER NOT NULL,
    step INTEGER NOT NULL,
    participants INTEGER NOT NULL,
    healed_from TEXT NOT NULL,
    created_us INTEGER NOT NULL,
    PRIMARY KEY (job, grp, epoch, quorum_id)
) WITHOUT ROWID;
