"""Storage: where state and the audit chain live, behind one interface.

- `store`: the `Store` protocol every backend implements, its errors, the known-head check and
  the migrations runner;
- `sqlite`, `postgres`: the two backends, with `groupcommit` (the batched writer they
  share) and `postgres_tx` (PostgreSQL's write transaction and placeholders); what a
  replication mode promises is the base's (rngcoord.server.replication), since the metrics
  and the status page show it too;
- `queries`: the SQL statements, in the portable dialect both backends run, with two of
  their own: `barrier_queries` (the join barrier's pending joins) and `attestation_queries`
  (the op-sequence checks);
- `stores`: `open_store(url)`, the one way to open a store;
- `migrations/`: each backend's schema, as numbered SQL files.

It may import the base modules at the package root and rngcoord.v1; nothing above it (the
audit, the rules, rpc, web, the process): pyproject.toml's layers contract checks it.
"""
