-- rngcoord schema, version 6 (SQLite): which launch formed an epoch.
-- Same meaning as migrations/postgres/006_launches.sql.
--
-- launch: JoinGroupRequest.launch of the join that completed the epoch's barrier (every rank
-- of one launch sends the same), '' for epochs formed before this version or by clients that
-- send none. restart_count: its TORCHELASTIC_RESTART_COUNT. A join of another launch does not
-- replace an epoch whose members were active within the last 60 s (JOB_IN_USE) unless it
-- asks for a takeover.
ALTER TABLE epochs ADD COLUMN launch TEXT NOT NULL DEFAULT '';
ALTER TABLE epochs ADD COLUMN restart_count INTEGER NOT NULL DEFAULT 0;
