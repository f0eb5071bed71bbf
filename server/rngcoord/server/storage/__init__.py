"""Storage: where state and the audit chain live, behind one interface.

- `store`: the `Store` protocol every backend implements, its errors, the known-head check and
  the migrations runner;
- `sqlite`, `postgres`: the two backends, with `groupcommit` (the batched writer they share)
  and `replication` (what PostgreSQL's replication mode promises);
- `queries`: every SQL statement, in the portable dialect both backends run;
- `stores`: `open_store(url)`, the one way to open a store;
- `migrations/`: each backend's schema, as numbered SQL files.

It may import the package root's base modules (errors, clock, logs, addresses, metrics) and
rngcoord.v1; nothing above it (the rules, the audit, rpc, web, the process).
"""
